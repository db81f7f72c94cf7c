"""Hugging Face Qwen3 and Qwen3-MoE: tiny random models built locally with transformers
(nothing downloaded) give transformers' logits (fp32, 1e-5) and greedy tokens in gigatron,
both ways; exports load with no missing or unexpected keys; both norm_topk_prob values map
to Megatron's router (softmax after top-k, or pre-softmax); what gigatron cannot express is
refused in one line."""
import dataclasses
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
    default_family,
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
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              head_dim=12, max_position_embeddings=128, rms_norm_eps=1e-5,
              tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 50000.0})


def _randomised(model, folder):
    """Weights (the q/k norms too) far enough from init for confident, varied routing."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # run every step
    model.generation_config.pad_token_id = 0
    if folder is not None:
        model.save_pretrained(folder)
    return model.eval()


def _qwen3(folder=None, **overrides):
    """A random Qwen3ForCausalLM (head_dim 12 != hidden / heads = 8)."""
    torch.manual_seed(0)
    kwargs = dict(COMMON, intermediate_size=40, num_hidden_layers=2)
    kwargs.update(overrides)
    return _randomised(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**kwargs)),
                       folder)


def _qwen3_moe(folder=None, **overrides):
    """A random Qwen3MoeForCausalLM: 3 layers, the middle one dense (mlp_only_layers)."""
    torch.manual_seed(0)
    kwargs = dict(COMMON, intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=3,
                  num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                  norm_topk_prob=True, router_aux_loss_coef=0.02)
    kwargs.update(overrides)
    return _randomised(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)),
                       folder)


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


def _assert_export_loads(folder, cls):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[kind], (kind, info[kind])
    return model.eval()


def test_qwen3_config_maps_to_qk_layernorm_and_kv_channels_and_back(tmp_path):
    _qwen3(tmp_path / "hf", tie_word_embeddings=True)
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert config.qk_layernorm and config.kv_channels == 12 and config.num_query_groups == 2
    assert (config.rotary_base, config.layernorm_epsilon, config.ffn_hidden_size) == \
        (50000.0, 1e-5, 40)
    assert not config.untie_embeddings_and_output_weights and not config.add_bias_linear
    assert default_family(config) == "qwen3"
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = config_to_hf(config, "qwen3")
    for key in ("head_dim", "intermediate_size", "rms_norm_eps", "tie_word_embeddings",
                "num_key_value_heads", "num_hidden_layers", "vocab_size", "attention_bias",
                "use_sliding_window", "sliding_window", "layer_types", "model_type"):
        assert exported[key] == source[key], key


def test_qwen3_moe_config_maps_to_megatron_moe_fields_and_back(tmp_path):
    _qwen3_moe(tmp_path / "hf")
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size,
            config.ffn_hidden_size) == (4, 2, 16, 40)
    assert config.moe_layer_freq == [1, 0, 1] and config.qk_layernorm
    assert config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax
    assert config.moe_aux_loss_coeff == 0.02 and default_family(config) == "qwen3_moe"
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = config_to_hf(config, "qwen3_moe")
    for key in ("moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
                "mlp_only_layers", "router_aux_loss_coef", "intermediate_size", "head_dim"):
        assert exported[key] == source[key], key
    # save_pretrained writes num_experts as num_local_experts; the published files (and
    # exports) say num_experts: both read
    assert exported["num_experts"] == source["num_local_experts"] == 4


@pytest.mark.parametrize("step, dense, pattern", [
    (1, [], 1), (2, [], [0, 1, 0, 1]), (1, [0, 3], [0, 1, 1, 0]), (2, [1], [0, 0, 0, 1])])
def test_decoder_sparse_step_and_mlp_only_layers_become_a_moe_layer_list(step, dense, pattern):
    hf = _qwen3_moe(num_hidden_layers=4, decoder_sparse_step=step, mlp_only_layers=dense)
    config, state = state_dict_from_hf(hf.state_dict(), hf.config.to_dict())
    assert config.moe_layer_freq == pattern
    for i, layer in enumerate(hf.model.layers):  # transformers' own placement: MoE has a gate
        assert (f"decoder.layers.{i}.mlp.router.weight" in state) == \
            hasattr(layer.mlp, "gate") == (pattern == 1 or pattern[i] == 1), i
    tokens = _tokens()
    torch.testing.assert_close(_logits(_gigatron(config, state), tokens), _logits(hf, tokens),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides", [
    {},  # GQA, untied, head_dim 12
    {"num_key_value_heads": 1, "tie_word_embeddings": True, "head_dim": 8},  # MQA, tied
], ids=["gqa_untied_head_dim_12", "mqa_tied"])
def test_qwen3_import_matches_transformers_logits(tmp_path, overrides):
    hf = _qwen3(tmp_path / "hf", **overrides)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    config, state = load_model(str(tmp_path / "gig"))
    assert state["decoder.layers.1.self_attention.q_layernorm.weight"].shape == \
        (config.kv_channels,)
    tokens = _tokens()
    torch.testing.assert_close(_logits(_gigatron(config, state), tokens), _logits(hf, tokens),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_import_matches_transformers_logits(tmp_path, norm_topk_prob):
    hf = _qwen3_moe(tmp_path / "hf", norm_topk_prob=norm_topk_prob, num_experts=8,
                    num_experts_per_tok=3)
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    config, state = load_model(str(tmp_path / "gig"))
    assert config.moe_router_pre_softmax == (not norm_topk_prob)
    tokens = _tokens()
    ours = _logits(_gigatron(config, state), tokens)
    torch.testing.assert_close(ours, _logits(hf, tokens), rtol=0, atol=1e-5)
    # the test can fail: the other routing, or no q/k norms, give other logits
    for change in ({"moe_router_pre_softmax": norm_topk_prob}, {"qk_layernorm": False}):
        other = dataclasses.replace(config, **change)
        kept = {k: v for k, v in state.items() if other.qk_layernorm
                or not k.endswith(("self_attention.q_layernorm.weight",
                                   "self_attention.k_layernorm.weight"))}
        assert not torch.allclose(_logits(_gigatron(other, kept), tokens), ours, atol=1e-3)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_router_is_megatrons_for_both_norm_topk_prob(norm_topk_prob):
    """transformers' Qwen3MoeTopKRouter (softmax over all experts, top-k, renormalised only
    with norm_topk_prob) equals Megatron-Core's softmax after top-k (norm_topk_prob true) or
    pre-softmax (false), and not the other."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(3)
    router = Qwen3MoeTopKRouter(transformers.Qwen3MoeConfig(
        hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm_topk_prob))
    torch.nn.init.normal_(router.weight, std=1.0)
    with torch.no_grad():
        logits, top_values, top_indices = router(torch.randn(64, 16))
    expected = torch.zeros_like(logits).scatter(1, top_indices, top_values)
    probs, routing_map = route(logits, RouterConfig(num_experts=8, topk=3,
                                                    pre_softmax=not norm_topk_prob))
    assert torch.equal(routing_map, expected > 0)
    torch.testing.assert_close(probs, expected, rtol=0, atol=1e-6)
    other, _ = route(logits, RouterConfig(num_experts=8, topk=3, pre_softmax=norm_topk_prob))
    assert not torch.allclose(other, expected, atol=1e-3)


def test_in_memory_fused_and_saved_per_expert_tensors_import_identically(tmp_path):
    hf = _qwen3_moe(tmp_path / "hf")
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf.state_dict()
    on_disk = load_hf_state_dict(str(tmp_path / "hf"))
    assert "model.layers.2.mlp.experts.3.up_proj.weight" in on_disk
    _, from_disk = read_hf(str(tmp_path / "hf"))
    _, from_memory = state_dict_from_hf(hf.state_dict(), hf.config.to_dict())
    assert from_disk.keys() == from_memory.keys()
    for name, tensor in from_disk.items():
        assert torch.equal(from_memory[name], tensor), name


@pytest.mark.parametrize("make, cls", [(_qwen3, "Qwen3ForCausalLM"),
                                       (_qwen3_moe, "Qwen3MoeForCausalLM")],
                         ids=["qwen3", "qwen3_moe"])
def test_export_loads_in_transformers_with_equal_logits_and_round_trips_exactly(tmp_path,
                                                                                  make, cls):
    make(tmp_path / "hf")
    hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [cls]
    exported = _assert_export_loads(str(tmp_path / "out"), getattr(transformers, cls))
    tokens = _tokens(seed=2)
    ours = _gigatron(*load_model(str(tmp_path / "gig")))
    torch.testing.assert_close(_logits(exported, tokens), _logits(ours, tokens), rtol=0,
                               atol=1e-5)
    before = load_hf_state_dict(str(tmp_path / "hf"))
    after = load_hf_state_dict(str(tmp_path / "out"))
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    config, state = load_model(str(tmp_path / "gig"))
    family = default_family(config)
    _, again = state_dict_from_hf(state_dict_to_hf(state, config, family),
                                  config_to_hf(config, family))
    assert again.keys() == state.keys()
    for name, tensor in state.items():
        assert torch.equal(again[name], tensor), name


def _tiny(**overrides):
    kwargs = dict(num_layers=3, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                  kv_channels=12, vocab_size=VOCAB, seq_length=16, activation="swiglu",
                  normalization="RMSNorm", position_embedding_type="rope",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True,
                  hidden_dropout=0.0, attention_dropout=0.0, qk_layernorm=True)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


@pytest.mark.parametrize("overrides, cls", [
    ({}, "Qwen3ForCausalLM"),
    ({"num_moe_experts": 4, "moe_ffn_hidden_size": 20, "moe_layer_freq": [0, 1, 1],
      "moe_router_pre_softmax": True}, "Qwen3MoeForCausalLM"),
], ids=["qwen3", "qwen3_moe_pre_softmax"])
def test_gigatron_initialised_qk_layernorm_model_exports_by_default(tmp_path, overrides, cls):
    config = _tiny(**overrides)
    model = GPTModel(config, seed=7)
    with torch.no_grad():  # q/k norm weights off their init of ones, so the map shows
        for name, p in model.named_parameters():
            if "q_layernorm" in name or "k_layernorm" in name:
                p.add_(0.3 * torch.randn_like(p))
    save_model(str(tmp_path / "gig"), config, model.state_dict(), "test")
    written, _ = gigatron_to_hf(str(tmp_path / "gig"), str(tmp_path / "out"))
    assert written["architectures"] == [cls]
    exported = _assert_export_loads(str(tmp_path / "out"), getattr(transformers, cls))
    tokens = _tokens(seed=3, seq=16)
    ours = _gigatron(*load_model(str(tmp_path / "gig")))
    torch.testing.assert_close(_logits(exported, tokens), _logits(ours, tokens), rtol=0,
                               atol=1e-5)


def _hf_greedy(hf, prompts, new):
    tokens, mask = left_pad(prompts, pad_token=0)
    out = hf.generate(input_ids=tokens, attention_mask=mask, max_new_tokens=new,
                      do_sample=False, pad_token_id=0)
    return out[:, tokens.shape[1]:].tolist()


@pytest.mark.parametrize("make", [_qwen3, _qwen3_moe], ids=["qwen3", "qwen3_moe"])
def test_greedy_tokens_equal_transformers_generate(make):
    hf = make()
    ours = _gigatron(*state_dict_from_hf(hf.state_dict(), hf.config.to_dict()))
    expected = _hf_greedy(hf, PROMPTS, NEW)
    assert generate(ours, PROMPTS, NEW).tokens == expected
    assert generate(ours, PROMPTS, NEW, use_cache=False).tokens == expected
    for prompt, tokens in zip(PROMPTS, expected):  # the batch is no shortcut
        assert generate(ours, [prompt], NEW).tokens == [tokens]


def test_converted_qwen3_moe_generates_transformers_tokens_from_the_cli(tmp_path):
    """HF folder -> `gigatron convert hf-to-gigatron` -> `gigatron generate --load` (the
    recorded --qk-layernorm, --kv-channels and --moe-* flags rebuild it) on 1 and 2
    tensor-parallel ranks: transformers' greedy tokens."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from multirank import run_on_ranks
    from test_generation_cli import _command

    hf = _qwen3_moe(tmp_path / "hf", norm_topk_prob=False)
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


def test_recorded_model_flags_rebuild_the_converted_qwen3_moe_config(tmp_path):
    from gigatron.training.checkpoint.convert import (config_from_flags, model_flags,
                                                      parse_model_flags, unexpressed_fields)

    _qwen3_moe(tmp_path / "hf", norm_topk_prob=False)
    config = hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    flags = model_flags(config)
    assert "--qk-layernorm" in flags and "--moe-router-pre-softmax" in flags
    rebuilt = config_from_flags(parse_model_flags(flags))
    assert unexpressed_fields(config, rebuilt) == []


@pytest.mark.parametrize("make, change, named", [
    (_qwen3, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,
              "layer_types": None}, "sliding_window=16 on layers [1]"),
    (_qwen3, {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 16},
     "sliding_window=16 on layers [1]"),
    (_qwen3, {"attention_bias": True}, "Qwen3 attention_bias=True"),
    (_qwen3, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "Qwen3 rope_type 'yarn'"),
    (_qwen3_moe, {"use_sliding_window": True, "sliding_window": 16},
     "Qwen3-MoE sliding_window=16 on layers [0, 1, 2]"),
    (_qwen3_moe, {"num_experts_per_tok": 1, "norm_topk_prob": True},
     "num_experts_per_tok=1 with norm_topk_prob=true"),
    (_qwen3_moe, {"decoder_sparse_step": 4}, "leaves no MoE layer"),
    (_qwen3_moe, {"hidden_act": "gelu"}, "Qwen3-MoE hidden_act 'gelu'"),
])
def test_unsupported_qwen3_config_is_one_line_naming_the_key(tmp_path, make, change, named):
    make(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
    with pytest.raises(ConversionError) as err:
        hf_to_gigatron(str(tmp_path / "hf"), str(tmp_path / "gig"))
    assert named in str(err.value) and "\n" not in str(err.value)


def test_sliding_window_no_layer_uses_is_accepted(tmp_path):
    """Qwen3's use_sliding_window applies from max_window_layers on: none when it is the
    layer count (and a window as long as the context is the whole sequence)."""
    hf = _qwen3(tmp_path / "hf", use_sliding_window=True, sliding_window=16,
                max_window_layers=2)
    config, state = read_hf(str(tmp_path / "hf"))
    tokens = _tokens()
    torch.testing.assert_close(_logits(_gigatron(config, state), tokens), _logits(hf, tokens),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("family, overrides, named", [
    ("llama", {}, "export it as qwen3"),
    ("gpt2", {}, "export it as qwen3"),
    ("mixtral", {"num_moe_experts": 4}, "export it as qwen3_moe"),
    ("qwen3", {"qk_layernorm": False}, "no qk_layernorm: export it as llama"),
    ("qwen3_moe", {"qk_layernorm": False, "num_moe_experts": 4}, "export it as mixtral"),
    ("qwen3", {"num_moe_experts": 4}, "export it as qwen3_moe"),
    ("qwen3_moe", {}, "export it as qwen3"),
    ("qwen3_moe", {"num_moe_experts": 4, "moe_router_score_function": "sigmoid"},
     "must be a softmax"),
    ("qwen3_moe", {"num_moe_experts": 4, "moe_shared_expert_intermediate_size": 16},
     "shared experts"),
    ("qwen3_moe", {"num_moe_experts": 4, "moe_expert_capacity_factor": 1.0},
     "Qwen3-MoE is dropless"),
    ("qwen3", {"layernorm_zero_centered_gamma": True}, "apply-layernorm-1p"),
])
def test_export_of_what_the_family_cannot_express_fails_in_one_line(family, overrides, named):
    with pytest.raises(ConversionError) as err:
        config_to_hf(_tiny(**overrides), family)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_tensors_of_a_qk_layernorm_model_are_not_written_without_their_norms():
    config = _tiny()
    with pytest.raises(ConversionError, match="export it as qwen3$"):
        state_dict_to_hf(GPTModel(config).state_dict(), config, "llama")
