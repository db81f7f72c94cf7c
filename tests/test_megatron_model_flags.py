"""Megatron's model flags build the model Megatron-Core builds for them: the MLP activation
(the default bias-GeLU fusion is the tanh GeLU; exact erf GeLU without the fusion or without
biases; SwiGLU; squared ReLU), grouped-query attention (Megatron's default of one group with
--group-query-attention alone), --kv-channels, RoPE base / percent / Llama 3.1 scaling, no
position embedding, untied output, normalization spellings. Numbers are checked against
torch's reference functions and, for RoPE scaling and GPT-2's GeLU, Hugging Face's."""
import math
import re

import pytest
import torch
import torch.nn.functional as F

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.transformer import (ACTIVATIONS, MLP, apply_rotary, rotary_cos_sin,
                                         rotary_inv_freq)
from gigatron.training.config.arguments import parse_args
from gigatron.models.megatron.args import megatron_activation
from gigatron.training.config.validation import ConfigError

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 100 "
        "--hidden-dropout 0 --attention-dropout 0")


def model_of(extra: str = "", base: str = BASE) -> TransformerConfig:
    return parse_args((base + " " + extra).split(), 1).model


def megatron_bias_gelu(x: torch.Tensor) -> torch.Tensor:
    """Megatron-Core's fused bias-GeLU forward, written out (its constants)."""
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def test_default_gelu_is_megatrons_bias_gelu_fusion_the_tanh_approximation():
    assert model_of().activation == "gelu_tanh"
    x = torch.linspace(-6, 6, 10001, dtype=torch.float64)
    ours = ACTIVATIONS["gelu_tanh"](x)
    torch.testing.assert_close(ours, F.gelu(x, approximate="tanh"), rtol=0, atol=0)
    torch.testing.assert_close(ours, megatron_bias_gelu(x), rtol=0, atol=1e-8)
    assert (ours - F.gelu(x)).abs().max() > 1e-4  # the erf GeLU is measurably different


def test_gpt2_zoo_models_use_hugging_faces_gelu_new():
    activations = pytest.importorskip("transformers.activations")
    x = torch.linspace(-6, 6, 1001)
    gelu_new = activations.ACT2FN["gelu_new"]
    torch.testing.assert_close(ACTIVATIONS["gelu_tanh"](x), gelu_new(x), rtol=1e-6, atol=1e-6)
    assert model_of("", "--model gpt2-124m --micro-batch-size 1 --train-iters 1 --lr 1 "
                    "--mock-data").activation == "gelu_tanh"


@pytest.mark.parametrize("extra,activation", [
    ("", "gelu_tanh"), ("--no-bias-gelu-fusion", "gelu"), ("--disable-bias-linear", "gelu"),
    ("--openai-gelu", "gelu_tanh"), ("--openai-gelu --no-bias-gelu-fusion", "gelu"),
    ("--swiglu", "swiglu"), ("--swiglu --no-bias-gelu-fusion", "swiglu"),
    ("--squared-relu", "squared_relu"), ("--squared-relu --disable-bias-linear",
                                         "squared_relu")])
def test_activation_flags_choose_megatron_cores_activation(extra, activation):
    assert model_of(extra).activation == activation


def test_megatron_activation_rule_table():
    assert megatron_activation(False, False, True, True) == "gelu_tanh"
    assert megatron_activation(False, False, False, True) == "gelu"
    assert megatron_activation(False, False, True, False) == "gelu"
    assert megatron_activation(True, False, True, True) == "swiglu"
    assert megatron_activation(False, True, True, True) == "squared_relu"


@pytest.mark.parametrize("activation,reference", [
    ("gelu", lambda h: F.gelu(h)), ("gelu_tanh", lambda h: F.gelu(h, approximate="tanh")),
    ("squared_relu", lambda h: F.relu(h) ** 2)])
def test_mlp_computes_the_chosen_activation(activation, reference):
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=10,
                            activation=activation)
    torch.manual_seed(0)
    mlp = MLP(cfg, None)
    for p in mlp.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(3, 2, 16)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    expected = F.linear(reference(F.linear(x, fc1.weight, fc1.bias)), fc2.weight, fc2.bias)
    torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)


def test_zoo_activation_shows_through_unless_an_activation_flag_is_given():
    zoo = "--model gpt2-124m --micro-batch-size 1 --train-iters 1 --lr 1 --mock-data"
    assert model_of("--no-bias-gelu-fusion", zoo).activation == "gelu"
    assert model_of("--squared-relu", zoo).activation == "squared_relu"
    llama = zoo.replace("gpt2-124m", "llama3-8b") + " --num-layers 1 --seq-length 64"
    assert model_of("--no-bias-gelu-fusion", llama).activation == "swiglu"


def test_swiglu_and_squared_relu_are_exclusive():
    with pytest.raises(ConfigError, match="--swiglu and --squared-relu are exclusive"):
        model_of("--swiglu --squared-relu")


def test_group_query_attention_alone_is_multi_query_as_in_megatron():
    m = model_of("--group-query-attention")
    assert m.num_query_groups == 1
    assert model_of("--group-query-attention --num-query-groups 2").num_query_groups == 2
    assert model_of("--num-key-value-heads 2").num_query_groups == 2  # Megatron-DeepSpeed
    assert model_of("").num_query_groups == 4
    with pytest.raises(ConfigError, match="--num-key-value-heads 2 and --num-query-groups 1 "
                                          "disagree"):
        model_of("--group-query-attention --num-query-groups 1 --num-key-value-heads 2")


def _mha_from_gqa(gqa: GPTModel, cfg: TransformerConfig) -> GPTModel:
    """The MHA model whose every head's key/value weights are its group's: Megatron-Core's
    definition of GQA."""
    from dataclasses import replace

    mha = GPTModel(replace(cfg, num_query_groups=cfg.num_attention_heads))
    hpg, d = cfg.num_attention_heads // cfg.num_query_groups, cfg.kv_channels
    state = gqa.state_dict()
    for name, value in state.items():
        if "linear_qkv" in name:  # rows: per group [q x hpg, k, v] -> per head [q, k, v]
            grouped = value.view(cfg.num_query_groups, hpg + 2, d, *value.shape[1:])
            heads = [torch.cat([grouped[g, j], grouped[g, hpg], grouped[g, hpg + 1]])
                     for g in range(cfg.num_query_groups) for j in range(hpg)]
            state[name] = torch.cat(heads)
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("groups", [1, 2])
def test_gqa_equals_mha_with_each_groups_keys_and_values_shared(groups):
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=50,
                            seq_length=8, num_query_groups=groups, hidden_dropout=0.0,
                            attention_dropout=0.0, position_embedding_type="rope")
    gqa = GPTModel(cfg)
    qkv = gqa.decoder.layers["0"].self_attention.linear_qkv.weight
    assert qkv.shape == ((4 + 2 * groups) * 8, 32)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gqa(ids), _mha_from_gqa(gqa, cfg)(ids), rtol=1e-5, atol=1e-5)


def test_kv_channels_set_the_head_width_and_softmax_scale():
    m = model_of("--kv-channels 16 --num-attention-heads 4 --hidden-size 34")
    assert (m.kv_channels, m.head_dim) == (16, 16)  # 34 is not divisible by 4: allowed
    model = GPTModel(m)
    attention = model.decoder.layers["0"].self_attention
    assert attention.linear_qkv.weight.shape == (4 * 3 * 16, 34)
    assert attention.linear_proj.weight.shape == (34, 64)
    assert attention.core_attention.scale == pytest.approx(1 / math.sqrt(16))
    ids = torch.randint(0, 100, (2, 16))
    assert model(ids).shape[:2] == (2, 16)
    with pytest.raises(ConfigError, match=r"--hidden-size \(34\) must be divisible by "
                                          r"--num-attention-heads"):
        model_of("--hidden-size 34")


def test_rotary_base_and_percent_follow_megatron_core():
    m = model_of("--position-embedding-type rope --rotary-base 500000 --rotary-percent 0.5")
    assert (m.rotary_base, m.rotary_percent, m.rotary_dim) == (500000.0, 0.5, 4)
    expected = 1.0 / (500000.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    torch.testing.assert_close(rotary_inv_freq(m), expected, rtol=0, atol=0)
    cos, sin = rotary_cos_sin(16, m, None)
    assert cos.shape == (16, 1, 1, 4)
    x = torch.randn(16, 2, 4, 8)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])  # the channels past rotary_dim pass
    half = torch.cat([-x[..., 2:4], x[..., :2]], dim=-1)
    torch.testing.assert_close(out[..., :4], x[..., :4] * cos + half * sin)
    assert not torch.allclose(out[1:, ..., :4], x[1:, ..., :4])


def test_rope_scaling_is_llama_3_1s_as_hugging_face_computes_it():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    m = model_of("--position-embedding-type rope --rotary-base 500000 --use-rope-scaling "
                 "--hidden-size 512 --num-attention-heads 4 --rope-scaling-factor 8")
    hf = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4,
                                  max_position_embeddings=16384, rope_parameters={
                                      "rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192,
                                      "rope_theta": 500000.0})
    expected, _ = _compute_llama3_parameters(hf)
    torch.testing.assert_close(rotary_inv_freq(m), expected.float(), rtol=0, atol=0)
    plain = rotary_inv_freq(model_of("--position-embedding-type rope --rotary-base 500000 "
                                     "--hidden-size 512 --num-attention-heads 4"))
    wavelength = 2 * math.pi / plain
    long, short = wavelength > 8192, wavelength < 2048
    torch.testing.assert_close(rotary_inv_freq(m)[long], plain[long] / 8)
    assert torch.equal(rotary_inv_freq(m)[short], plain[short])


def test_interpolation_factor_divides_positions():
    m = model_of("--position-embedding-type rope --rotary-seq-len-interpolation-factor 4")
    plain = model_of("--position-embedding-type rope")
    cos, _ = rotary_cos_sin(16, m, None)
    cos_plain, _ = rotary_cos_sin(4, plain, None)
    torch.testing.assert_close(cos[::4], cos_plain)  # position 4k is rotated as k


def test_odd_rotary_width_is_refused():
    with pytest.raises(ConfigError, match=r"RoPE rotates --kv-channels x --rotary-percent = "
                                          r"8 x 0.4 -> 3 channels"):
        model_of("--position-embedding-type rope --rotary-percent 0.4")


def test_position_embedding_none_and_unsupported_types():
    m = model_of("--position-embedding-type none")
    names = [n for n, _ in GPTModel(m).named_parameters()]
    assert not any("position" in n for n in names)
    assert model_of("--use-rotary-position-embeddings").position_embedding_type == "rope"
    with pytest.raises(ConfigError, match="--position-embedding-type mrope is not supported"):
        model_of("--position-embedding-type mrope")
    with pytest.raises(ConfigError, match="--use-rotary-position-embeddings contradicts"):
        model_of("--use-rotary-position-embeddings --position-embedding-type none")


def test_no_position_embedding_is_accepted_only_with_rope_as_in_megatron():
    with_rope = model_of("--position-embedding-type rope --no-position-embedding")
    assert with_rope == model_of("--position-embedding-type rope")
    assert model_of("--use-rotary-position-embeddings --no-position-embedding") == with_rope
    for other in ("", "--position-embedding-type none"):
        with pytest.raises(ConfigError, match="--no-position-embedding works only with"):
            model_of(other + " --no-position-embedding")


def test_untied_output_layer_and_normalization_spellings():
    m = model_of("--untie-embeddings-and-output-weights --normalization rmsnorm")
    assert m.untie_embeddings_and_output_weights and m.normalization == "RMSNorm"
    model = GPTModel(m)
    assert model.output_layer.weight is not None
    assert not torch.equal(model.output_layer.weight, model.embedding.word_embeddings.weight)
    assert model_of("--normalization layernorm").normalization == "LayerNorm"
    assert model_of("").normalization == "LayerNorm"


@pytest.mark.parametrize("flags,backend", [
    ("", "sdpa"), ("--attention-backend auto", "sdpa"), ("--attention-backend flash", "sdpa"),
    ("--attention-backend fused", "sdpa"), ("--attention-backend unfused", "unfused"),
    ("--attention-backend local", "unfused"), ("--use-flash-attn", "sdpa"),
    ("--transformer-impl transformer_engine --use-mcore-models", "sdpa")])
def test_attention_selectors_map_to_gigatrons_backends(flags, backend):
    assert model_of(flags).attention_backend == backend


def test_use_flash_attn_with_an_unfused_backend_is_a_contradiction():
    with pytest.raises(ConfigError, match=re.escape("--use-flash-attn contradicts "
                                                    "--attention-backend local")):
        model_of("--use-flash-attn --attention-backend local")
