"""Hugging Face mixtures of experts: tiny random Mixtral models built locally with transformers
(nothing downloaded) give transformers' logits and greedy tokens in gigatron, both ways, and
round-trip exactly (Qwen3-MoE: tests/test_hf_qwen3.py)."""
import json
import os
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.config import TransformerConfig  # noqa: E402
from gigatron.models.generation import generate, left_pad  # noqa: E402
from gigatron.models.gpt import GPTModel  # noqa: E402
from gigatron.models.hf_common import ConversionError  # noqa: E402
from gigatron.models.hf_convert import (  # noqa: E402
    config_to_hf,
    load_hf_state_dict,
    read_hf,
    state_dict_from_hf,
    state_dict_to_hf,
)
from gigatron.models.moe.router import RouterConfig, route  # noqa: E402
from gigatron.training.checkpoint.convert import (  # noqa: E402
    gigatron_to_hf,
    hf_to_gigatron,
    load_model,
    save_model,
)

VOCAB = 101  # not a multiple of 128: gigatron pads the table, only real logits are compared
PROMPTS = [[5, 17, 3, 99, 41, 8, 70], [100, 7], [60, 61, 62, 1]]
NEW = 12


def _mixtral(folder=None, **overrides):
    """A random MixtralForCausalLM with weights large enough for confident, varied routing."""
    torch.manual_seed(0)
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, max_position_embeddings=128, rope_theta=50000.0,
                  rms_norm_eps=1e-5, router_aux_loss_coef=0.02, tie_word_embeddings=False,
                  bos_token_id=None, eos_token_id=None)
    kwargs.update(overrides)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kwargs))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # run every step
    model.generation_config.pad_token_id = 0
    if folder is not None:
        model.save_pretrained(folder)
    return model.eval()


def _tokens(seed=1, batch=2, seq=20):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq), generator=g)


def _gigatron(config, state):
    model = GPTModel(config)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _logits(model, tokens):
    with torch.no_grad():
        if isinstance(model, GPTModel):
            return model(tokens)[..., :VOCAB]  # padded rows are not tokens
        return model(tokens).logits


def _assert_export_loads(folder):
    model, info = transformers.MixtralForCausalLM.from_pretrained(folder,
                                                                  output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    return model.eval()


def test_mixtral_config_maps_to_megatron_moe_fields_and_back(tmp_path):
    _mixtral(tmp_path / "hf")
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == \
        (4, 2, 24)
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert config.moe_aux_loss_coeff == 0.02 and config.moe_router_load_balancing_type == \
        "aux_loss"
    assert (config.rotary_base, config.layernorm_epsilon, config.num_query_groups) == \
        (50000.0, 1e-5, 2)
    assert config.untie_embeddings_and_output_weights and config.moe_layer_freq == 1
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = config_to_hf(config, "mixtral")
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size",
                "router_aux_loss_coef", "rms_norm_eps", "tie_word_embeddings", "hidden_size",
                "num_key_value_heads", "num_hidden_layers", "vocab_size"):
        assert exported[key] == source[key], key
    assert exported["rope_parameters"]["rope_theta"] == source["rope_parameters"]["rope_theta"]


@pytest.mark.parametrize("overrides", [
    {},  # 4 experts, top-2, GQA, untied head
    {"num_local_experts": 8, "num_experts_per_tok": 3, "num_key_value_heads": 1,
     "tie_word_embeddings": True, "head_dim": 12},  # top-3 of 8, MQA, tied, head_dim != h/n
], ids=["top2_of_4_gqa_untied", "top3_of_8_mqa_tied"])
def test_mixtral_import_matches_transformers_logits(tmp_path, overrides):
    hf = _mixtral(tmp_path / "hf", **overrides)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    config, state = load_model(str(tmp_path / "gig"))
    assert state["decoder.layers.1.mlp.router.weight"].shape == \
        (config.num_moe_experts, config.hidden_size)
    tokens = _tokens()
    torch.testing.assert_close(_logits(_gigatron(config, state), tokens), _logits(hf, tokens),
                               rtol=0, atol=1e-5)


def test_pre_softmax_routing_would_not_be_mixtral(tmp_path):
    """The logits test can fail: Megatron's pre-softmax (no renormalisation) changes them."""
    hf = _mixtral(tmp_path / "hf")
    config, state = read_hf(str(tmp_path / "hf"))
    config.moe_router_pre_softmax = True
    tokens = _tokens()
    assert not torch.allclose(_logits(_gigatron(config, state), tokens), _logits(hf, tokens),
                              atol=1e-3)


def test_mixtral_router_is_megatron_softmax_after_topk():
    """Softmax over all experts, top-k, renormalise (transformers' MixtralTopKRouter) equals
    Megatron-Core's softmax of the top-k logits (pre_softmax False), not pre-softmax."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    torch.manual_seed(3)
    hf_config = transformers.MixtralConfig(hidden_size=16, num_local_experts=8,
                                           num_experts_per_tok=2)
    router = MixtralTopKRouter(hf_config)
    torch.nn.init.normal_(router.weight, std=1.0)
    hidden = torch.randn(64, 16)
    with torch.no_grad():
        logits, top_values, top_indices = router(hidden)
    expected = torch.zeros_like(logits).scatter(1, top_indices, top_values)
    probs, routing_map = route(logits, RouterConfig(num_experts=8, topk=2))
    assert torch.equal(routing_map, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)
    pre, _ = route(logits, RouterConfig(num_experts=8, topk=2, pre_softmax=True))
    assert not torch.allclose(pre, expected, atol=1e-3)  # unnormalised: not Mixtral's


def test_in_memory_fused_and_saved_per_expert_tensors_import_identically(tmp_path):
    """transformers 5 holds the experts fused (gate_up_proj) and saves them per expert (w1,
    w2, w3): both forms give the same gigatron tensors."""
    hf = _mixtral(tmp_path / "hf")
    on_disk = load_hf_state_dict(str(tmp_path / "hf"))
    assert "model.layers.0.block_sparse_moe.experts.3.w3.weight" in on_disk
    _, from_disk = read_hf(str(tmp_path / "hf"))
    _, from_memory = state_dict_from_hf(hf.state_dict(), hf.config.to_dict())
    assert from_disk.keys() == from_memory.keys()
    for name, tensor in from_disk.items():
        assert torch.equal(from_memory[name], tensor), name


def test_mixtral_export_loads_in_transformers_with_equal_logits(tmp_path):
    _mixtral(tmp_path / "hf", tie_word_embeddings=True)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == \
        ["MixtralForCausalLM"]
    exported = _assert_export_loads(str(tmp_path / "out"))
    tokens = _tokens(seed=2)
    ours = _gigatron(*load_model(str(tmp_path / "gig")))
    torch.testing.assert_close(_logits(exported, tokens), _logits(ours, tokens), rtol=0,
                               atol=1e-5)


def test_gigatron_initialised_moe_model_exports_to_mixtral(tmp_path):
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               num_query_groups=2, vocab_size=VOCAB, seq_length=16,
                               activation="swiglu", normalization="RMSNorm",
                               position_embedding_type="rope", add_bias_linear=False,
                               untie_embeddings_and_output_weights=True, hidden_dropout=0.0,
                               attention_dropout=0.0, num_moe_experts=4, moe_ffn_hidden_size=20,
                               moe_router_topk=2)
    save_model(str(tmp_path / "gig"), config, GPTModel(config, seed=7).state_dict(), "test")
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    exported = _assert_export_loads(str(tmp_path / "out"))
    tokens = _tokens(seed=3, seq=16)
    ours = _gigatron(*load_model(str(tmp_path / "gig")))
    torch.testing.assert_close(_logits(exported, tokens), _logits(ours, tokens), rtol=0,
                               atol=1e-5)


def test_state_dict_round_trips_exactly(tmp_path):
    """HF folder -> gigatron checkpoint -> HF folder gives the same tensors, bit for bit, and
    gigatron -> HF -> gigatron gives the same state dict."""
    _mixtral(tmp_path / "hf")
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    before = load_hf_state_dict(str(tmp_path / "hf"))
    after = load_hf_state_dict(str(tmp_path / "out"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    config, state = load_model(str(tmp_path / "gig"))
    _, again = state_dict_from_hf(state_dict_to_hf(state, config, "mixtral"),
                                  config_to_hf(config, "mixtral"))
    assert again.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name


def _hf_greedy(hf, prompts, new):
    tokens, mask = left_pad(prompts, pad_token=0)
    out = hf.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    return out[:, tokens.shape[1]:].tolist()


def test_greedy_tokens_equal_transformers_generate():
    hf = _mixtral()
    ours = _gigatron(*state_dict_from_hf(hf.state_dict(), hf.config.to_dict()))
    expected = _hf_greedy(hf, PROMPTS, NEW)
    assert generate(ours, PROMPTS, NEW).tokens == expected
    assert generate(ours, PROMPTS, NEW, use_cache=False).tokens == expected
    for prompt, tokens in zip(PROMPTS, expected):  # the batch is no shortcut
        assert generate(ours, [prompt], NEW).tokens == [tokens]


def test_converted_mixtral_generates_transformers_tokens_from_the_cli(tmp_path):
    """HF folder -> `gigatron convert hf-to-gigatron` -> `gigatron generate --load` (no model
    flag: the recorded --num-experts/--moe-* flags rebuild it) on 1 and 2 tensor-parallel
    ranks: transformers' greedy tokens."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multirank import run_on_ranks
    from test_generation_cli import _command

    hf = _mixtral(tmp_path / "hf")
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


def test_recorded_model_flags_rebuild_the_converted_mixtral_config(tmp_path):
    from gigatron.training.checkpoint.convert import (config_from_flags, model_flags,
                                                      parse_model_flags, unexpressed_fields)

    _mixtral(tmp_path / "hf", num_local_experts=8, num_experts_per_tok=3)
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    flags = model_flags(config)
    assert flags[flags.index("--num-experts") + 1] == "8"
    rebuilt = config_from_flags(parse_model_flags(flags))
    assert unexpressed_fields(config, rebuilt) == []


@pytest.mark.parametrize("change, named", [
    ({"sliding_window": 16}, "sliding_window=16"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1"),
    ({"hidden_act": "gelu"}, "Mixtral hidden_act 'gelu'"),
])
def test_unsupported_mixtral_config_is_one_line_naming_the_key(tmp_path, change, named):
    _mixtral(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(ConversionError) as err:
        hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert named in str(err.value) and "\n" not in str(err.value)


def _moe_config(**overrides):
    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                  seq_length=16, activation="swiglu", normalization="RMSNorm",
                  position_embedding_type="rope", add_bias_linear=False, num_moe_experts=4,
                  moe_ffn_hidden_size=16)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


@pytest.mark.parametrize("family, overrides, named", [
    ("mixtral", {"moe_shared_expert_intermediate_size": 16}, "shared experts"),
    ("mixtral", {"moe_expert_capacity_factor": 1.0}, "moe_expert_capacity_factor"),
    ("mixtral", {"moe_router_score_function": "sigmoid"}, "softmax after top-k"),
    ("mixtral", {"moe_router_pre_softmax": True}, "--moe-router-pre-softmax"),
    ("mixtral", {"moe_layer_freq": [1, 0]}, "moe_layer_freq"),
    ("mixtral", {"num_moe_experts": None, "moe_ffn_hidden_size": None}, "export it as llama"),
    ("llama", {}, "export it as mixtral"),
    ("gpt2", {}, "export it as mixtral"),
])
def test_export_of_what_the_family_cannot_express_fails_in_one_line(family, overrides, named):
    with pytest.raises(ConversionError) as err:
        config_to_hf(_moe_config(**overrides), family)
    assert named in str(err.value) and "\n" not in str(err.value)
