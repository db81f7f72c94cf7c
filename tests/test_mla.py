"""Multi-latent attention and YaRN: gigatron's MLA layer equals transformers'
DeepseekV3Attention on the same weights (fp32; with and without query compression, plain
RoPE and YaRN with its softmax mscale), YaRN's frequencies equal Megatron-Core's formulas,
and the config refuses what MLA cannot run, one line each."""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.config import TransformerConfig  # noqa: E402
from gigatron.models.mla.attention import MultiLatentAttention  # noqa: E402
from gigatron.models.mla.rope import yarn_concentration, yarn_inv_freq  # noqa: E402
from gigatron.models.transformer import rotary_cos_sin  # noqa: E402

HIDDEN, HEADS, SEQ = 48, 4, 24
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 1.0}


def mla_config(q_lora_rank=20, rope_type="rope", **overrides) -> TransformerConfig:
    """A tiny MLA model whose value heads (12) are narrower than its query/key heads (16+8)."""
    kwargs = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=64,
                  seq_length=SEQ, multi_latent_attention=True, q_lora_rank=q_lora_rank,
                  kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                  position_embedding_type="rope", normalization="RMSNorm",
                  layernorm_epsilon=1e-6, qk_layernorm=True, add_bias_linear=False,
                  hidden_dropout=0.0, attention_dropout=0.0, rope_type=rope_type)
    if rope_type == "yarn":
        kwargs.update(rotary_scaling_factor=YARN["factor"],
                      original_max_position_embeddings=YARN["original_max_position_embeddings"],
                      mscale=YARN["mscale"], mscale_all_dim=YARN["mscale_all_dim"])
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def hf_attention(config: TransformerConfig, rope_parameters):
    hf_config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=HIDDEN, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, q_lora_rank=config.q_lora_rank,
        kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_head_dim,
        qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
        rms_norm_eps=1e-6, max_position_embeddings=4 * SEQ, rope_parameters=rope_parameters,
        num_hidden_layers=1, num_mtp_layers=0)
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    layer = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(
        hf_config, 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.3)
    rotary = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RotaryEmbedding(
        hf_config)
    return layer.eval(), rotary


def copy_hf_weights(ours: MultiLatentAttention, hf) -> None:
    """transformers' DeepseekV3Attention names -> Megatron-Core's (one to one)."""
    pairs = {"linear_kv_down_proj": hf.kv_a_proj_with_mqa, "kv_layernorm": hf.kv_a_layernorm,
             "linear_kv_up_proj": hf.kv_b_proj, "linear_proj": hf.o_proj}
    if hf.q_lora_rank is None:
        pairs["linear_q_proj"] = hf.q_proj
    else:
        pairs.update(linear_q_down_proj=hf.q_a_proj, q_layernorm=hf.q_a_layernorm,
                     linear_q_up_proj=hf.q_b_proj)
    with torch.no_grad():
        for name, module in pairs.items():
            getattr(ours, name).weight.copy_(module.weight)


@pytest.mark.parametrize("q_lora_rank,rope", [(20, "default"), (None, "default"),
                                              (20, "yarn")])
def test_mla_equals_transformers_deepseek_v3_attention(q_lora_rank, rope):
    rope_parameters = YARN if rope == "yarn" else {"rope_type": "default",
                                                   "rope_theta": 10000.0}
    config = mla_config(q_lora_rank, "yarn" if rope == "yarn" else "rope")
    hf, hf_rotary = hf_attention(config, rope_parameters)
    ours = MultiLatentAttention(config, None, None)
    copy_hf_weights(ours, hf)
    x = torch.randn(2, SEQ, HIDDEN, generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(SEQ)[None].expand(2, -1)
    with torch.no_grad():
        expected = hf(x, hf_rotary(x, position_ids), None)[0]
        got = ours(x.transpose(0, 1), rotary_cos_sin(SEQ, config, None)).transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_yarn_frequencies_and_scale_equal_megatron_core():
    yarn = pytest.importorskip(
        "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding")
    dim, base, factor, original = 64, 10000.0, 40.0, 4096
    low, high = yarn._yarn_find_correction_range(32, 1, dim, base, original, True)
    keep = 1.0 - yarn._yarn_linear_ramp_mask(low, high, dim // 2, device="cpu")
    exponents = torch.arange(0, dim, 2, dtype=torch.float32) / dim
    expected = (1.0 / (factor * base ** exponents)) * (1 - keep) + \
        (1.0 / base ** exponents) * keep
    torch.testing.assert_close(yarn_inv_freq(dim, base, factor, original), expected)
    assert yarn_concentration(factor, 0.707, 0.707) == 1.0
    assert yarn_concentration(factor, 1.0, 0.0) == pytest.approx(
        yarn._yarn_get_concentration_factor(factor, 1.0, 0.0))
    # MLA's softmax scale: mscale(factor, mscale_all_dim)^2 / sqrt(q head dim)
    config = mla_config(rope_type="yarn", rotary_scaling_factor=factor, mscale_all_dim=1.0)
    ours = MultiLatentAttention(config, None, None)
    mscale = 0.1 * math.log(factor) + 1.0
    assert ours.core_attention.scale == pytest.approx(mscale * mscale / math.sqrt(24))


def test_rope_type_defaults_to_yarn_with_mla_only():
    assert mla_config(rope_type=None).rope_type == "yarn"
    assert TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,
                             vocab_size=8).rope_type == "rope"


def test_mla_config_problems_name_the_field_and_the_fix():
    config = mla_config()
    problems = config.problems(tp_size=3)  # q_lora_rank 20 and 16 + 8 = 24 over tp 3
    assert any(p.startswith("q_lora_rank (20) must be divisible") for p in problems)
    assert not any("kv_lora_rank + qk_pos_emb_head_dim" in p for p in problems)
    with pytest.raises(ValueError, match="make it even") as error:
        mla_config(qk_pos_emb_head_dim=7)
    assert len(str(error.value).splitlines()) == 1
    with pytest.raises(ValueError, match="rope_type='ntk' is not one of"):
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=8,
                          rope_type="ntk")


def _graph_names(tensor):
    seen, stack, names = set(), [tensor.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        stack += [next_fn for next_fn, _ in fn.next_functions]
    return names


def test_narrower_values_run_the_fused_kernel_not_the_s_by_s_math_one():
    """torch's SDPA falls back to its math kernel (an s x s probability matrix kept for
    backward) when values are narrower than queries; CoreAttention pads them instead."""
    from gigatron.models.transformer import CoreAttention

    core = CoreAttention(mla_config(), None, softmax_scale=0.2)
    q, k = (torch.randn(SEQ, 2, HEADS, 24, requires_grad=True) for _ in range(2))
    v = torch.randn(SEQ, 2, HEADS, 12, requires_grad=True)
    out = core(q, k, v)
    names = _graph_names(out)
    assert out.shape == (SEQ, 2, HEADS * 12)
    assert not any(name.startswith("Bmm") for name in names), names
    reference = torch.softmax((q.permute(1, 2, 0, 3) @ k.permute(1, 2, 3, 0)) * 0.2 +
                              torch.full((SEQ, SEQ), float("-inf")).triu(1), dim=-1) @ \
        v.permute(1, 2, 0, 3)
    torch.testing.assert_close(out, reference.permute(2, 0, 1, 3).reshape(SEQ, 2, -1),
                               rtol=1e-5, atol=1e-5)


PLAN_CASES = [{}, {"qk_layernorm": False}, {"q_lora_rank": None}, {"v_head_dim": 32},
              {"recompute_granularity": "selective"}, {"hidden_dropout": 0.1}]


@pytest.mark.parametrize("overrides", PLAN_CASES, ids=[str(c) for c in PLAN_CASES])
def test_plan_counts_what_autograd_keeps_for_mla(overrides):
    """`gigatron plan`'s activations of an MLA model equal the bytes autograd keeps (the
    harness of tests/test_plan_memory.py; measured exact on CPU fp32), where the standard
    attention's count was 11 % short."""
    from test_plan_memory import _held_activation_bytes

    from gigatron.models.gpt import GPTModel
    from gigatron.training.plan.memory import activation_terms, chunk_activations

    s, b, vocab, layers = 64, 2, 256, 3
    config = mla_config(**dict(dict(num_layers=layers, hidden_size=64, vocab_size=vocab,
                                    make_vocab_size_divisible_by=8, seq_length=s,
                                    max_position_embeddings=s, activation="swiglu",
                                    q_lora_rank=32, kv_lora_rank=24, v_head_dim=16),
                               **overrides))
    torch.manual_seed(0)
    model = GPTModel(config).train()
    ids = torch.randint(0, vocab, (b, s))
    measured = _held_activation_bytes(model, lambda: model(input_ids=ids, labels=ids))
    planned, _ = chunk_activations(config, activation_terms(config, 1, on_gpu=False), layers,
                                   True, True, s * b)
    assert abs(planned / measured - 1) < 0.01, (planned, measured)
