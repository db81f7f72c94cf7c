"""gigatron.generate on models imported from tiny random Hugging Face GPT-2 and Llama
models (built locally, no downloads) gives transformers' greedy `generate` tokens, token for
token, for a batch of left-padded prompts; Llama 3.1 rope_scaling's four keys round-trip."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.generation import generate, left_pad  # noqa: E402
from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.models.hf_convert import config_to_hf, state_dict_from_hf  # noqa: E402

VOCAB = 101  # not a multiple of 128: the padded logits must never be drawn
PROMPTS = [[5, 17, 3, 99, 41, 8, 70], [100, 7], [60, 61, 62, 1]]
NEW = 12
SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
           "high_freq_factor": 8.0, "original_max_position_embeddings": 32}


def _hf_model(family, **overrides):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=32,
                                         n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
                                         **overrides)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=128,
                                          tie_word_embeddings=False, **overrides)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the init: confident, far-apart logits
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # run every step
    model.generation_config.pad_token_id = 0
    return model.eval()


def _imported(hf):
    config, state = state_dict_from_hf(hf.state_dict(), hf.config.to_dict())
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _hf_greedy(hf, prompts, new):
    tokens, mask = left_pad(prompts, pad_token=0)
    out = hf.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    return out[:, tokens.shape[1]:].tolist()


@pytest.mark.parametrize("family,overrides", [
    ("gpt2", {}),
    ("llama", {"rope_theta": 50000.0}),
    ("llama", {"rope_scaling": SCALING, "rope_theta": 10000.0}),
], ids=["gpt2", "llama_gqa", "llama31_rope_scaling"])
def test_greedy_tokens_equal_transformers_generate(family, overrides):
    hf = _hf_model(family, **overrides)
    ours = _imported(hf)
    expected = _hf_greedy(hf, PROMPTS, NEW)
    assert generate(ours, PROMPTS, NEW).tokens == expected
    assert generate(ours, PROMPTS, NEW, use_cache=False).tokens == expected
    # the batch is no shortcut: each prompt alone gives transformers' tokens too
    for prompt, tokens in zip(PROMPTS, expected):
        assert generate(ours, [prompt], NEW).tokens == [tokens]


def test_llama31_rope_scaling_keys_round_trip_and_change_the_model():
    hf = _hf_model("llama", rope_scaling=SCALING, rope_theta=10000.0)
    ours = _imported(hf)
    c = ours.config
    assert (c.rope_scaling, c.rope_scaling_factor, c.rope_scaling_low_freq_factor,
            c.rope_scaling_high_freq_factor,
            c.rope_scaling_original_max_position_embeddings) == (True, 4.0, 2.0, 8.0, 32)
    rope = config_to_hf(c, "llama")["rope_parameters"]
    assert {k: rope[k] for k in SCALING} == SCALING
    tokens = torch.tensor([list(range(1, 60))])
    with torch.no_grad():
        logits = ours(tokens)[..., :VOCAB]
        torch.testing.assert_close(logits, hf(tokens).logits, rtol=0, atol=1e-4)
        # the non-default factors matter at these positions: Megatron's defaults differ
        plain = _imported(hf)
        plain.config.rope_scaling_low_freq_factor = 1.0
        plain.config.rope_scaling_high_freq_factor = 4.0
        plain.config.rope_scaling_original_max_position_embeddings = 8192
        assert not torch.allclose(plain(tokens)[..., :VOCAB], logits, atol=1e-3)


def test_converted_checkpoint_generates_transformers_tokens_from_the_cli(tmp_path):
    """HF folder -> `gigatron convert hf-to-gigatron` -> `gigatron generate --load` (no model
    flag) on 1 rank and on 2 tensor-parallel ranks: transformers' greedy tokens."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multirank import run_on_ranks
    from test_generation_cli import _command

    hf = _hf_model("llama", rope_scaling=SCALING, rope_theta=10000.0)
    hf.save_pretrained(tmp_path / "hf")
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
