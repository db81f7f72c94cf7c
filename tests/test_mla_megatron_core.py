"""gigatron's multi-latent attention equals Megatron-Core's own MLASelfAttention (installed
megatron-core, local spec: column-parallel down/up projections, latent norms, row-parallel
output) on the same weights: outputs and every weight gradient, fp32, plain RoPE and YaRN.

Megatron-Core's MLA does not run on CPU as shipped: its RotaryEmbedding and
YarnRotaryEmbedding put their tables on `torch.cuda.current_device()` (patched here to the
CPU, in a forked rank), it tests Transformer Engine classes with `isinstance` (told there is
none), and its local DotProductAttention takes no separate key/value head sizes, so the core
attention (softmax(QK^T scale) V, causal; no parameters) is a stand-in given Megatron-Core's
softmax scale. Everything with parameters, RoPE and the scale are Megatron-Core's."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from multirank import run_on_ranks
from test_mla import HIDDEN, SEQ, mla_config

pytest.importorskip("megatron.core")


class _CoreAttention(torch.nn.Module):
    """Causal SDPA with the scale Megatron-Core's MLA computes (its DotProductAttention's
    constructor, without the k/v channel split it lacks)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type,
                 softmax_scale=None, k_channels=None, v_channels=None, cp_comm_type=None,
                 pg_collection=None) -> None:
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, attention_mask, attn_mask_type=None, packed_seq_params=None):
        s, b = q.shape[:2]
        out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)),
                                             is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)


def _megatron_core_mla(rope_type):
    warnings.simplefilter("ignore")
    torch.cuda.current_device = lambda: "cpu"  # this forked rank only
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import multi_latent_attention as mla
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    mla.HAVE_TE = False
    ours = mla_config(rope_type=rope_type)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
              "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
              "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "qk_layernorm", "add_bias_linear")
    config = MLATransformerConfig(
        **{f: getattr(ours, f) for f in fields}, normalization="RMSNorm",
        layernorm_epsilon=ours.layernorm_epsilon, use_cpu_initialization=True,
        attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False,
        masked_softmax_fusion=False)
    linear = ColumnParallelLinear
    submodules = mla.MLASelfAttentionSubmodules(
        linear_q_proj=linear, linear_q_down_proj=linear, linear_q_up_proj=linear,
        linear_kv_down_proj=linear, linear_kv_up_proj=linear, core_attention=_CoreAttention,
        linear_proj=RowParallelLinear, q_layernorm=WrappedTorchNorm,
        kv_layernorm=WrappedTorchNorm)
    module = mla.MLASelfAttention(config, submodules, layer_number=1,
                                  attn_mask_type=AttnMaskType.causal)
    return module, ours


def _compare(rank, world, rope_type):
    """(max output difference, max relative weight-gradient difference) of the two MLAs."""
    from gigatron.models.mla.attention import MultiLatentAttention
    from gigatron.models.transformer import rotary_cos_sin

    reference, config = _megatron_core_mla(rope_type)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    ours = MultiLatentAttention(config, None, None)
    missing, unexpected = ours.load_state_dict(reference.state_dict(), strict=False)
    assert not missing and all(k.endswith("_extra_state") for k in unexpected), \
        (missing, unexpected)
    x = torch.randn(SEQ, 2, HIDDEN, generator=g)
    grad = torch.randn(SEQ, 2, HIDDEN, generator=g)
    expected = reference(x, None)[0]
    got = ours(x, rotary_cos_sin(SEQ, config, None))
    expected.backward(grad)
    got.backward(grad)
    ref_grads = dict(reference.named_parameters())
    grad_error = max(((p.grad - ref_grads[n].grad).norm() / ref_grads[n].grad.norm()).item()
                     for n, p in ours.named_parameters())
    return (got - expected).abs().max().item(), grad_error


@pytest.mark.parametrize("rope_type", ["rope", "yarn"])
def test_mla_equals_megatron_core_mla_self_attention(rope_type):
    output_error, grad_error = run_on_ranks(_compare, 1, rope_type, timeout=300)[0]
    assert output_error < 1e-5 and grad_error < 1e-5, (output_error, grad_error)
