"""Throughput arithmetic: model FLOPs per token, TFLOP/s per device, MFU, peak memory.

FLOPs per token follow the PaLM convention (Chowdhery et al. 2022, appendix B):

    flops_per_token = 6 * N + 12 * L * h * s

N counts the parameters that take part in matrix multiplies: every decoder-layer parameter,
the final norm and the output layer (padded vocab x hidden; with tied embeddings the shared
matrix counts once, as the output projection). A mixture-of-experts layer counts its ACTIVE
parameters, those a token passes through: the router, top-k routed experts and the shared
experts (so MFU is on active parameters, as for Mixtral's "13B active of 47B"). Input embedding tables (word and learned
position) are lookups and are not counted. The 12*L*h*s term is attention's QK^T and AV
matmuls (forward + backward) at sequence length s, without halving for the causal mask;
with multi-latent attention, whose heads need not add up to h and whose values are narrower,
it is 6 * L * s * heads * (q/k head + v head), and N counts MLA's own projections.
Multi-token prediction's depths (--mtp-num-layers) count as layers of the last decoder
layer's kind, each with its 2h -> h projection, three norms and another pass through the
output layer. These are *model* FLOPs: activation recomputation is not counted, so MFU is comparable
across recomputation settings.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch

from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.training.observe.devices import for_device_name

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig

def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Vocab padded to a multiple of divisible_by x tp, as Megatron pads it."""
    multiple = max(divisible_by, 1) * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def _get(config, name: str, default=None):
    value = getattr(config, name, default)
    return default if value is None else value


def matmul_parameter_count(config: "TransformerConfig", tp: int = 1) -> int:
    """N of the FLOPs formula: decoder layers + final norm + output layer (see module doc)."""
    h, layers = config.hidden_size, config.num_layers
    heads = config.num_attention_heads
    groups = _get(config, "num_query_groups", heads)
    ffn = _get(config, "ffn_hidden_size", 4 * h)
    bias = _get(config, "add_bias_linear", True)
    swiglu = _get(config, "activation", "gelu") in ("swiglu", "quick_geglu")  # a gated fc1: twice as wide
    norm = h * (2 if _get(config, "normalization", "LayerNorm") == "LayerNorm" else 1)
    d = _get(config, "kv_channels", h // heads)  # channels per head (--kv-channels)
    q, kv = heads * d, 2 * groups * d
    attention = h * (q + kv) + q * h + ((q + kv) + h if bias else 0)
    if _get(config, "multi_latent_attention", False):
        attention = _mla_parameters(config, bias)

    def mlp(width: int) -> int:
        mlp_in = 2 * width if swiglu else width
        return h * mlp_in + width * h + ((mlp_in + h) if bias else 0)

    vocab = padded_vocab_size(config.vocab_size, _get(config, "make_vocab_size_divisible_by",
                                                      128), tp)
    per_layer = attention + 2 * norm
    moe = sum(moe_layer_pattern(config)) if _get(config, "num_moe_experts") else 0
    dense_mlps = (layers - moe) * mlp(ffn)
    moe_mlps = moe * _moe_active(config, mlp) if moe else 0
    mtp = 0
    if _get(config, "mtp_num_layers", 0):  # each depth: a layer of the last one's kind, its
        last_moe = bool(moe) and moe_layer_pattern(config)[-1]  # 2h -> h projection, 3
        layer = per_layer + (_moe_active(config, mlp) if last_moe else mlp(ffn))  # norms
        mtp = config.mtp_num_layers * (layer + 2 * h * h + 3 * norm + vocab * h)  # + output
    return layers * per_layer + dense_mlps + moe_mlps + norm + vocab * h + mtp


def _mla_parameters(config: "TransformerConfig", bias: bool) -> int:
    """Multi-latent attention's parameters: the query and key/value down- and
    up-projections, their latent norms (--qk-layernorm) and the output projection."""
    h, heads, rank = config.hidden_size, config.num_attention_heads, config.q_lora_rank
    norms = bool(config.qk_layernorm)
    q_head = config.qk_head_dim + config.qk_pos_emb_head_dim
    query = h * heads * q_head if rank is None else \
        h * rank + rank * heads * q_head + (rank if norms else 0)
    latent = config.kv_lora_rank
    key_value = h * (latent + config.qk_pos_emb_head_dim) + \
        latent * heads * (config.qk_head_dim + config.v_head_dim) + (latent if norms else 0)
    return query + key_value + heads * config.v_head_dim * h + (h if bias else 0)


def _attention_width(config: "TransformerConfig") -> int:
    """Channels of QK^T plus AV per token and position, over the heads: 2h (one head size
    for queries, keys and values, Megatron's formula), MLA's heads x (q/k head + v head)."""
    if _get(config, "multi_latent_attention", False):
        return config.num_attention_heads * (config.qk_head_dim + config.qk_pos_emb_head_dim
                                             + config.v_head_dim)
    return 2 * config.hidden_size


def _moe_active(config: "TransformerConfig", mlp: Callable[[int], int]) -> int:
    """Parameters one token passes through in an MoE layer: router (bias-free), top-k
    experts, shared experts."""
    experts = config.num_moe_experts or 0
    shared = _get(config, "moe_shared_expert_intermediate_size")
    routed = config.moe_router_topk * mlp(_get(config, "moe_ffn_hidden_size",
                                               config.ffn_hidden_size))
    return experts * config.hidden_size + routed + (mlp(shared) if shared else 0)


def flops_per_token(config: "TransformerConfig", tp: int = 1) -> float:
    """Model FLOPs (forward + backward) per trained token: 6N + 12 L h s (L counting the
    multi-token prediction depths' layers)."""
    layers = config.num_layers + _get(config, "mtp_num_layers", 0)
    return 6.0 * matmul_parameter_count(config, tp) + \
        6.0 * layers * _attention_width(config) * config.seq_length


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def device_peak_tflops(device: torch.device, dtype: Union[torch.dtype, str]) -> Optional[float]:
    """The hardware table's peak (training/observe/devices.py) for this device and params
    dtype (torch dtype or 'bf16'|'fp16'|'fp32'); None if unknown."""
    if device.type != "cuda":
        return None
    dtype_name = dtype if isinstance(dtype, str) else _DTYPE_NAMES.get(dtype, str(dtype))
    row = for_device_name(torch.cuda.get_device_name(device))
    return None if row is None else row.peak(dtype_name)


def throughput(tokens: float, seconds: float, flops_token: float, world_size: int,
               peak_tflops: Optional[float]) -> dict:
    """tokens/s, TFLOP/s per device and MFU (None without a peak) over one interval."""
    tokens_per_s = tokens / seconds if seconds > 0 else 0.0
    tflops = tokens_per_s * flops_token / world_size / 1e12
    mfu = tflops / peak_tflops if peak_tflops else None
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": tflops, "mfu": mfu}


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: accelerator max allocated, else the host peak RSS."""
    if device.type != "cpu":
        accel = getattr(torch, "accelerator", None)
        fn = getattr(accel, "max_memory_allocated", None)
        if fn is not None:
            return int(fn(device))
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
