"""A GEMM's time from its shape: tile and wave quantisation over the GPU's SMs, and the idle
gap the GPU leaves between two kernels (issue 32).

cuBLAS computes an M x N output in tiles, one tile per SM at a time; a GEMM whose tiles do
not fill the last wave leaves SMs idle, and a partial tile at the edge computes padding
(NVIDIA, "Matrix Multiplication Background User's Guide", sections "Tile quantization" and
"Wave quantization"). The fraction of the SMs' time that does useful work is

    useful tiles / (waves x SMs),  useful tiles = M N / (tile_m tile_n),
    waves = ceil(ceil(M / tile_m) ceil(N / tile_n) / SMs)

with the tile cuBLAS's heuristic picks for the shape; the model takes the best-quantised of
`TILES`. A full wave runs at the device's matmul ceiling (`gemm_rate`). A linear
layer runs three GEMMs per micro-batch (forward tokens x n; dgrad tokens x k; wgrad k x n),
each quantised on its own output.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Dict, Optional, Tuple

from gigatron.training.observe.devices import Hardware

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig

GEMM_EFFICIENCY = 0.80
"""Fraction of the dense peak a GEMM's full waves sustain on a device without a measured
matmul ceiling (devices.py's matmul_tflops; each shape's tile and wave quantisation
comes on top): the H200 session's matmuls ran at 769 TFLOP/s (0.777 of 989.4) in the GPT
1.3B step, whose GEMMs quantise to 0.975 on 132 SMs (0.797); its 8192^3 ceiling was 0.803,
the H100 SXM's published one 0.801."""

TILES: Tuple[Tuple[int, int], ...] = ((128, 256), (256, 128), (192, 192), (128, 128))
"""Output tiles cuBLAS runs: 128x256, 256x128 and 192x192 are the nvjet_sm90 kernels of the
H200 session's trace (bench/results/2026-11-26-h200/trace_gpt3-1.3b.json.gz: every one of
its 339 GEMMs; persistent, one CTA per SM: grid 132); 128x128 is the Ampere tile of NVIDIA's
guide (above). Taking the best of them is optimistic where cuBLAS's heuristic is not."""

KERNEL_GAP_S = 2.3e-6
"""Idle GPU time between two consecutive kernels of a layer (launch latency the queue does
not hide, the next kernel's ramp-up): the H200 session's trace, one layer of GPT 1.3B at
micro-batch 8: 37 us over 16 forward kernels, 110 us over 48 backward ones (2.3 us each)."""
KERNELS_FORWARD = 16
"""Kernels of one layer's forward (the same trace: norms, q/k/v, flash attention, output
projection, bias-dropout-add, fc1, GeLU, fc2, and their copies)."""
KERNELS_BACKWARD = 48
"""Kernels of one layer's backward (the same trace: each GEMM's dgrad and wgrad, bias
gradients, the norms', attention's and activation's backward, gradient accumulation)."""


def wave_efficiency(m: int, n: int, sms: Optional[int]) -> float:
    """Useful fraction of the SMs' time for an m x n output (1.0 when the SM count is
    unknown): the best-quantised tile of `TILES`."""
    if not sms or m <= 0 or n <= 0:
        return 1.0
    best = 0.0
    for tile_m, tile_n in TILES:
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n)
        waves = math.ceil(tiles / sms)
        best = max(best, m * n / (tile_m * tile_n) / (waves * sms))
    return best


def linear_efficiency(tokens: int, k: int, n: int, sms: Optional[int]
                      ) -> Tuple[float, float]:
    """(forward, backward) wave efficiency of a linear layer y = x W, x: tokens x k, W: k x n
    (the backward's dgrad tokens x k and wgrad k x n outputs, equal FLOPs each)."""
    forward = wave_efficiency(tokens, n, sms)
    dgrad, wgrad = wave_efficiency(tokens, k, sms), wave_efficiency(k, n, sms)
    return forward, 2.0 / (1.0 / dgrad + 1.0 / wgrad)


def linears_seconds(shapes: Tuple[Tuple[int, int], ...], tokens: int, flop_rate: float,
                    sms: Optional[int]) -> Tuple[float, float]:
    """(forward, backward) seconds of linear layers of (k, n) each over `tokens` rows at
    `flop_rate` FLOP/s for a full wave."""
    forward = backward = 0.0
    for k, n in shapes:
        flops = 2.0 * tokens * k * n
        fwd_eff, bwd_eff = linear_efficiency(tokens, k, n, sms)
        forward += flops / (flop_rate * fwd_eff)
        backward += 2 * flops / (flop_rate * bwd_eff)
    return forward, backward


def named_linears(c: "TransformerConfig", tp: int) -> Dict[str, Tuple[int, int]]:
    """(k, n) of one layer's linears on one tp rank, by Megatron-Core's module name: q/k/v
    (linear_qkv), or multi-latent attention's projections (linear_q_proj, or
    linear_q_down_proj + linear_q_up_proj with --q-lora-rank; linear_kv_down_proj,
    linear_kv_up_proj: column-parallel, the down-projections' latents gathered after),
    the output projection (linear_proj), linear_fc1, linear_fc2."""
    h, a, ffn = c.hidden_size, c.num_attention_heads, c.ffn_hidden_size
    fc1 = 2 * ffn if c.activation in ("swiglu", "quick_geglu") else ffn
    out: Dict[str, Tuple[int, int]] = {}
    if c.multi_latent_attention:
        q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
        if c.q_lora_rank is None:
            out["linear_q_proj"] = (h, a * q_head // tp)
        else:
            out["linear_q_down_proj"] = (h, c.q_lora_rank // tp)
            out["linear_q_up_proj"] = (c.q_lora_rank, a * q_head // tp)
        out["linear_kv_down_proj"] = (h, (c.kv_lora_rank + c.qk_pos_emb_head_dim) // tp)
        out["linear_kv_up_proj"] = (c.kv_lora_rank, a * (c.qk_head_dim + c.v_head_dim) // tp)
        out["linear_proj"] = (a * c.v_head_dim // tp, h)
    else:
        g, d = c.num_query_groups, c.head_dim
        out["linear_qkv"] = (h, g * (a // g + 2) * d // tp)
        out["linear_proj"] = (a * d // tp, h)
    out["linear_fc1"], out["linear_fc2"] = (h, fc1 // tp), (ffn // tp, h)
    return out


def layer_shapes(c: "TransformerConfig", tp: int) -> Tuple[Tuple[int, int], ...]:
    """(k, n) of one layer's linears on one tp rank (`named_linears`, in order; their FLOPs
    are cost._layer_flops's dense count)."""
    return tuple(named_linears(c, tp).values())


def gemm_rate(hw: Hardware, dtype_name: str) -> float:
    """FLOP/s of a GEMM's full waves: the device's measured matmul ceiling for 16-bit
    (devices.py), else GEMM_EFFICIENCY of the dense peak."""
    if hw.matmul_tflops is not None and dtype_name in ("bf16", "fp16"):
        return hw.matmul_tflops * 1e12
    return (hw.peak(dtype_name) or hw.peak("fp32") or 1.0) * 1e12 * GEMM_EFFICIENCY
