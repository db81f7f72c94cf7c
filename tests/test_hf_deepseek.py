"""Hugging Face DeepSeek-V3: tiny random DeepseekV3ForCausalLM models built locally with
transformers (nothing downloaded; multi-latent attention, a dense first layer then MoE
layers with sigmoid group-limited routing, the correction bias and shared experts) give
transformers' logits in gigatron (fp32, 1e-5) and its greedy tokens through the MLA KV
cache (and from `gigatron generate` at tp1 and tp2); exports load with no missing or
unexpected keys and the same logits, and round-trip the tensors exactly; what the
converter cannot express is refused in one line naming the key."""
import dataclasses
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.generation import generate, left_pad  # noqa: E402
from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.models.hf_common import ConversionError  # noqa: E402
from gigatron.models.hf_convert import (  # noqa: E402
    config_to_hf,
    default_family,
    load_hf_state_dict,
    state_dict_from_hf,
    state_dict_to_hf,
)
from gigatron.training.checkpoint.convert import (  # noqa: E402
    config_from_flags,
    gigatron_to_hf,
    hf_to_gigatron,
    load_model,
    model_flags,
    parse_model_flags,
    unexpressed_fields,
)

VOCAB = 101
PROMPTS = [[5, 17, 3, 99, 41, 8, 70], [100, 7], [60, 61, 62, 1]]
NEW = 10
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def _deepseek_v3(folder=None, **overrides):
    """3 layers (the first dense), 8 routed experts in 4 groups (top-4 from 2 groups), one
    shared expert, query compression, YaRN; weights far from init, a correction bias."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                  moe_intermediate_size=12, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
                  routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24,
                  qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
                  topk_group=2, num_experts_per_tok=4, first_k_dense_replace=1,
                  max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters=YARN, bos_token_id=None, eos_token_id=None,
                  num_mtp_layers=0)
    kwargs.update(overrides)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**kwargs))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.2 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if folder is not None:
        model.save_pretrained(folder)
    return model.eval()


def _tokens(seed=1, batch=2, seq=20):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _gigatron(config, state):
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        if isinstance(model, GPTModel):
            return model(tokens)[..., :VOCAB]
        return model(tokens).logits


def _hf_greedy(hf, prompts, new):
    tokens, mask = left_pad(prompts, pad_token=0)
    out = hf.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    return out[:, tokens.shape[1]:].tolist()


@pytest.mark.parametrize("overrides", [
    {},
    {"q_lora_rank": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e4},
     "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "tie_word_embeddings": True},
], ids=["yarn_q_lora_groups", "rope_no_q_lora_one_group_tied"])
def test_import_matches_transformers_logits(tmp_path, overrides):
    hf = _deepseek_v3(tmp_path / "hf", **overrides)
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert config.multi_latent_attention and config.moe_layer_freq == [0, 1, 1]
    assert default_family(config) == "deepseek_v3"
    config, state = load_model(str(tmp_path / "gig"))
    tokens = _tokens()
    torch.testing.assert_close(_logits(_gigatron(config, state), tokens), _logits(hf, tokens),
                               rtol=0, atol=1e-5)


def test_export_loads_in_transformers_with_equal_logits_and_round_trips_exactly(tmp_path):
    _deepseek_v3(tmp_path / "hf")
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    exported, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    tokens = _tokens(seed=2)
    ours = _gigatron(*load_model(str(tmp_path / "gig")))
    torch.testing.assert_close(_logits(exported.eval(), tokens), _logits(ours, tokens),
                               rtol=0, atol=1e-5)
    before, after = (load_hf_state_dict(str(tmp_path / d)) for d in ("hf", "out"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    config, state = load_model(str(tmp_path / "gig"))
    _, again = state_dict_from_hf(state_dict_to_hf(state, config, "deepseek_v3"),
                                  config_to_hf(config, "deepseek_v3"))
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name
    assert unexpressed_fields(config, config_from_flags(parse_model_flags(
        model_flags(config)))) == []


def test_greedy_tokens_through_the_mla_cache_equal_transformers_generate():
    hf = _deepseek_v3()
    ours = _gigatron(*state_dict_from_hf(hf.state_dict(), hf.config.to_dict()))
    expected = _hf_greedy(hf, PROMPTS, NEW)
    assert generate(ours, PROMPTS, NEW).tokens == expected
    assert generate(ours, PROMPTS, NEW, use_cache=False).tokens == expected


def test_converted_checkpoint_generates_transformers_tokens_at_tp1_and_tp2(tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multirank import run_on_ranks
    from test_generation_cli import _command

    hf = _deepseek_v3(tmp_path / "hf")
    folder = str(tmp_path / "ckpt")
    (code, _, err), = run_on_ranks(_command, 1, "cli.convert", [
        "hf-to-gigatron", "--load", str(tmp_path / "hf"), "--save", folder])
    assert code == 0, err
    expected = _hf_greedy(hf, PROMPTS, NEW)
    for world in (1, 2):
        out = str(tmp_path / f"tp{world}.jsonl")
        args = ["--load", folder, "--max-new-tokens", str(NEW), "--ignore-eod", "--output", out]
        for prompt in PROMPTS:
            args += ["--prompt", " ".join(map(str, prompt))]
        results = run_on_ranks(_command, world, "cli.generate", args)
        assert [r[0] for r in results] == [0] * world, results
        with open(out) as f:
            assert [json.loads(line)["tokens"] for line in f] == expected


def test_moonlight_norm_epsilon_imports_and_exports_with_transformers_logits(tmp_path):
    """Moonlight's rms_norm_eps 1e-5 is the layer and final norms' (--norm-epsilon); the
    latent norms keep transformers' 1e-6 (--mla-latent-norm-epsilon). The latents are made
    small (their mean square near the epsilons) so that either epsilon shows in the logits."""
    hf = _deepseek_v3(q_lora_rank=None, rms_norm_eps=1e-5)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.kv_a_proj_with_mqa.weight.mul_(3e-3)
    hf.save_pretrained(tmp_path / "hf")
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert (config.layernorm_epsilon, config.mla_latent_norm_epsilon) == (1e-5, 1e-6)
    assert unexpressed_fields(config, config_from_flags(parse_model_flags(
        model_flags(config)))) == []
    tokens = _tokens()
    config, state = load_model(str(tmp_path / "gig"))
    ours = _gigatron(config, state)
    torch.testing.assert_close(_logits(ours, tokens), _logits(hf, tokens), rtol=0, atol=1e-5)
    one_epsilon = _gigatron(dataclasses.replace(config, mla_latent_norm_epsilon=None), state)
    assert (_logits(one_epsilon, tokens) - _logits(hf, tokens)).abs().max() > 1e-3
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rms_norm_eps"] == 1e-5
    exported, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    torch.testing.assert_close(_logits(exported.eval(), tokens), _logits(ours, tokens),
                               rtol=0, atol=1e-5)
    # a latent epsilon transformers cannot hold is refused on export, naming the flag
    with pytest.raises(ConversionError, match="--mla-latent-norm-epsilon") as err:
        config_to_hf(dataclasses.replace(config, mla_latent_norm_epsilon=None), "deepseek_v3")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, named", [
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "ranks groups by their best 2"),
    ({"norm_topk_prob": False}, "norm_topk_prob=false"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"rope_interleave": False}, "rope_interleave=false"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type 'linear'"),
])
def test_unsupported_config_is_one_line_naming_the_key(tmp_path, change, named):
    _deepseek_v3(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(ConversionError) as err:
        hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert named in str(err.value) and "\n" not in str(err.value)


def _deepseek_v2(folder=None, **overrides):
    """DeepSeek-V2 (Lite's shape in small): no query compression, greedy softmax routing
    (top-3 of 8, not renormalised, scaled by 1.5), two shared experts, the first layer dense."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                  moe_intermediate_size=12, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
                  routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=None,
                  qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
                  topk_method="greedy", num_experts_per_tok=3, first_k_dense_replace=1,
                  max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707),
                  bos_token_id=None, eos_token_id=None)
    kwargs.update(overrides)
    model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if folder is not None:
        model.save_pretrained(folder)
    return model.eval()


def test_deepseek_v2_imports_as_pre_softmax_routing_and_exports_back(tmp_path):
    hf = _deepseek_v2(tmp_path / "hf")
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert config.moe_router_pre_softmax and config.moe_router_score_function == "softmax"
    assert config.moe_router_topk_scaling_factor == 1.5 and default_family(config) == \
        "deepseek_v2"
    ours = _gigatron(*load_model(str(tmp_path / "gig")))
    tokens = _tokens()
    torch.testing.assert_close(_logits(ours, tokens), _logits(hf, tokens), rtol=0, atol=1e-5)
    assert generate(ours, PROMPTS, NEW).tokens == _hf_greedy(hf, PROMPTS, NEW)
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    exported, info = transformers.DeepseekV2ForCausalLM.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    torch.testing.assert_close(_logits(exported.eval(), tokens), _logits(ours, tokens),
                               rtol=0, atol=1e-5)
    before, after = (load_hf_state_dict(str(tmp_path / d)) for d in ("hf", "out"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def test_deepseek_v2_group_limited_greedy_that_limits_is_refused(tmp_path):
    _deepseek_v2(tmp_path / "hf", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    with pytest.raises(ConversionError) as err:
        hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert "ranks groups by their best expert" in str(err.value)
    assert "\n" not in str(err.value)
