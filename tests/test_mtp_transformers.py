"""Multi-token prediction's depth 1 equals transformers' own MTP module (transformers 5's
`MtpModel`, which DeepSeek-V3 checkpoints' extra layer loads into for speculative decoding;
transformers has no MTP training loss): on a tiny random DeepSeek-V3 (MLA, YaRN, dense and
MoE layers; the MTP block of the last layer's kind) with the same weights, gigatron's depth-1
per-token loss equals the cross entropy of MtpModel's logits against the token two places
ahead (fp32, 1e-5). The structure is the same: cat(enorm(embedding of token i + 1),
hnorm(main hidden i)), eh_proj, the decoder layer, a final norm and the shared head; MtpModel
takes the next tokens' positions, which RoPE's relative angles make the same attention."""
from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(pytest.importorskip("transformers.modeling_layers"), "MtpModel"):
    pytest.skip("this transformers has no MtpModel", allow_module_level=True)

from test_hf_deepseek import _deepseek_v3, _tokens  # noqa: E402


def test_depth_one_equals_transformers_mtp_model():
    from transformers.modeling_layers import MtpModel

    from gigatron.models.gpt import GPTModel
    from gigatron.models.hf_convert import state_dict_from_hf
    from gigatron.models.hf_deepseek import state_dict_from_hf as deepseek_from_hf

    hf = _deepseek_v3(num_mtp_layers=1)  # the last layer MoE, and so the MTP block
    mtp = MtpModel(hf, 1).eval()
    with torch.no_grad():  # fresh values: MtpModel leaves some tensors uninitialised
        for name, p in mtp.layers.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else
                    0.2 * torch.randn_like(p))
        mtp.layers[0].mtp_block.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    hf_config = hf.config.to_dict()
    config, state = state_dict_from_hf(hf.state_dict(), hf_config)
    config = dataclasses.replace(config, mtp_num_layers=1)
    # the MTP block by a DeepSeek-V3 checkpoint's names: HF's layer num_layers
    last, layer = f"model.layers.{config.num_layers}.", mtp.layers[0]
    block = {last + k: v for k, v in layer.mtp_block.state_dict().items()}
    block.update({last + "enorm.weight": layer.enorm.weight,
                  last + "hnorm.weight": layer.hnorm.weight,
                  last + "eh_proj.weight": layer.eh_proj.weight,
                  last + "shared_head.norm.weight": layer.post_norm.weight})
    state = deepseek_from_hf({**hf.state_dict(), **block}, config)
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    model.eval()
    tokens, labels = _tokens(seed=1), _tokens(seed=2)
    b, s = tokens.shape
    with torch.no_grad():
        ours = model(input_ids=tokens, labels=labels)[1, :, :s - 1]
        hidden = hf.model(tokens).last_hidden_state
        positions = torch.arange(s).expand(b, s)
        out = mtp.forward_layer(0, hidden[:, :-1], positions[:, 1:], None,
                                input_ids=tokens[:, 1:])
        logits = mtp._project_to_logits(out)
        theirs = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, 1:],
                                                   reduction="none")
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    unrolled = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels[:, :-1],
                                                 reduction="none")
    assert (ours - unrolled).abs().max() > 1e-2  # the labels' roll is seen


def test_deepseek_converter_maps_the_mtp_layer_both_ways_with_mtp_num_layers():
    from gigatron.models.gpt import GPTModel
    from gigatron.models.hf_deepseek import config_from_hf, config_to_hf, state_dict_from_hf
    from gigatron.models.hf_deepseek import state_dict_to_hf

    hf = _deepseek_v3(num_mtp_layers=1)
    config = dataclasses.replace(config_from_hf(hf.config.to_dict()), mtp_num_layers=1)
    model = GPTModel(config, seed=4)
    state = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
    exported = state_dict_to_hf(state, config)
    last = f"model.layers.{config.num_layers}."
    block = {k[len(last):] for k in exported if k.startswith(last)}
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
            "self_attn.kv_b_proj.weight", "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias"} <= block, block
    dense = dataclasses.replace(config, mtp_num_layers=None)
    assert set(exported) - {last + k for k in block} == set(state_dict_to_hf(
        {k: v for k, v in state.items() if not k.startswith("mtp.")}, dense))
    assert config_to_hf(config)["num_nextn_predict_layers"] == 1
    back = state_dict_from_hf(exported, config)
    assert set(back) == set(state)
    for k, v in state.items():
        assert torch.equal(back[k], v), k
    model.load_state_dict(back, strict=False)  # the non-float buffers stay the model's
