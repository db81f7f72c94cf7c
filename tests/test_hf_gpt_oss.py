"""Hugging Face gpt-oss: a tiny random GptOssForCausalLM built locally with transformers
(nothing downloaded; YaRN RoPE, sliding and full layers, sinks, biases, 4 experts with fused
interleaved gate/up tensors, clamp biting) converts to gigatron with transformers' logits
(fp32, 1e-5 relative) and greedy tokens, and exports back: the export loads with no missing,
unexpected or mismatched keys and gives the same logits; MXFP4 checkpoints are refused in
one line naming the fix (dequantize)."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.generation import generate  # noqa: E402
from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.models.hf_common import ConversionError  # noqa: E402
from gigatron.models.hf_convert import config_from_hf, default_family, read_hf  # noqa: E402
from gigatron.training.checkpoint.convert import gigatron_to_hf, hf_to_gigatron  # noqa: E402

VOCAB = 101
HF = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
          head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
          num_hidden_layers=3, sliding_window=4, max_position_embeddings=256,
          bos_token_id=None, eos_token_id=None, pad_token_id=None)
PROMPTS = [[5, 17, 3, 99, 41, 8, 70], [100, 7], [60, 61, 62, 1]]


def _gpt_oss(folder):
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**HF))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(folder)
    return model.eval()


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


def _tokens(seq=20):
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf")
    hf = _gpt_oss(folder)
    config, state = read_hf(str(folder))
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    return folder, hf, model.eval()


def test_config_maps_to_megatron_gpt_oss_fields(converted):
    folder, _, model = converted
    c = model.config
    assert c.window_size == (3, 0) and c.window_attn_skip_freq == 2
    assert (c.softmax_type, c.activation, c.glu_linear_offset, c.activation_func_clamp_value) \
        == ("learnable", "quick_geglu", 1.0, 7.0)
    assert (c.rope_type, c.rotary_scaling_factor, c.original_max_position_embeddings,
            c.yarn_correction_range_round_to_int) == ("yarn", 32.0, 4096, False)
    assert c.add_bias_linear and c.num_moe_experts == 4 and not c.moe_router_pre_softmax
    assert default_family(c) == "gpt_oss"


def test_logits_and_greedy_tokens_equal_transformers(converted):
    _, hf, model = converted
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)[..., :VOCAB]
    assert _rel(got, want) < 1e-5
    for prompt in PROMPTS:
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert generate(model, [prompt], 10).tokens[0] == theirs[0, len(prompt):].tolist()


def test_export_loads_without_missing_keys_and_gives_the_same_logits(converted, tmp_path):
    folder, hf, _ = converted
    hf_to_gigatron(str(folder), str(tmp_path / "gig"))
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    back, info = transformers.GptOssForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                               output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    source = json.loads((folder / "config.json").read_text())
    exported = json.loads((tmp_path / "out" / "config.json").read_text())
    for key in ("sliding_window", "layer_types", "rope_parameters", "swiglu_limit",
                "num_local_experts", "num_experts_per_tok", "head_dim", "attention_bias"):
        assert exported[key] == source[key], key
    tokens = _tokens()
    with torch.no_grad():
        assert _rel(back.eval()(tokens).logits, hf(tokens).logits) < 1e-5


def test_mxfp4_checkpoints_are_refused_naming_the_fix():
    hf = transformers.GptOssConfig(**HF).to_dict()
    hf["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ConversionError, match="dequantize them to bf16 first"):
        config_from_hf(hf)


def test_converted_gpt_oss_generates_transformers_tokens_from_the_cli_at_tp1_and_tp2(
        converted, tmp_path):
    """HF folder -> `gigatron convert hf-to-gigatron` -> `gigatron generate --load` (the
    recorded --window-size, --softmax-type, --quick-geglu ... and --enable-gpt-oss flags
    rebuild it) on 1 and 2 tensor-parallel ranks (sinks split with the heads), left-padded
    prompts in one batch: transformers' greedy tokens."""
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multirank import run_on_ranks
    from test_generation_cli import _command

    from gigatron.models.generation import left_pad

    folder, hf, _ = converted
    ckpt = str(tmp_path / "ckpt")
    (code, _, err), = run_on_ranks(_command, 1, "cli.convert", [
        "hf-to-gigatron", "--load", str(folder), "--save", ckpt])
    assert code == 0, err
    tokens, mask = left_pad(PROMPTS, pad_token=0)
    out = hf.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=8,
                      do_sample=False, pad_token_id=0)
    expected = out[:, tokens.shape[1]:].tolist()
    for world in (1, 2):
        path = str(tmp_path / f"tp{world}.jsonl")
        args = ["--load", ckpt, "--max-new-tokens", "8", "--ignore-eod", "--output", path]
        for prompt in PROMPTS:
            args += ["--prompt", " ".join(map(str, prompt))]
        results = run_on_ranks(_command, world, "cli.generate", args)
        assert [r[0] for r in results] == [0] * world, results
        with open(path) as f:
            assert [json.loads(line)["tokens"] for line in f] == expected
