"""FP8 GEMMs through `torch._scaled_mm`, and the quantisers of Megatron's FP8 recipes.

Every FP8 GEMM here is C = A B^T with both operands stored as [rows, K], K contiguous (the
"TN" layout cuBLAS's FP8 GEMM needs); `_scaled_mm` gets B^T as a column-major view. An
operand is an `FP8Operand`: its FP8 bytes and the factors that dequantise them
(`scale_inv`, TE's name): one scalar (per tensor), one per row and 128 columns (1x128 tiles,
DeepSeek-V3's activations and gradients) or one per 128x128 tile (its weights).

`torch._scaled_mm` multiplies tensorwise and rowwise-scaled operands on this CPU (torch
2.13) and on H100/H200. Blockwise-scaled operands have their own form on sm90 CUDA builds
(`F.scaled_mm` with BlockWise1x128 / BlockWise128x128), not on the CPU: there,
`blockwise_by_rowwise_k_blocks` -- the one fallback -- splits K into 128-wide blocks, runs
one rowwise `_scaled_mm` per block (within a K block a 1x128 tile's factor is a row factor
and a 128x128 tile's a column factor) and sums the blocks in fp32, which is DeepSeek-V3's
"promote to fp32 every 128 elements of K" accumulation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK = 128
TENSOR, ROW_BLOCKS, SQUARE_BLOCKS = "tensor", "1x128", "128x128"


@dataclass
class FP8Operand:
    """A GEMM operand in FP8: `data` [rows, K] and the factors that dequantise it."""

    data: torch.Tensor
    # (): per tensor; [rows, ceil(K/128)]: 1x128; [ceil(rows/128), ceil(K/128)]: 128x128
    scale_inv: torch.Tensor
    layout: str = TENSOR

    def t(self) -> "FP8Operand":
        """The transposed operand, K-contiguous again (a 1x128 operand has no transpose: its
        tiles run along K; quantise the transposed tensor instead, as TE's columnwise copy)."""
        if self.layout == ROW_BLOCKS:
            raise ValueError("FP8Operand.t: 1x128 tiles run along K; quantise x.t() instead")
        scale_inv = self.scale_inv if self.layout == TENSOR else self.scale_inv.t().contiguous()
        return FP8Operand(self.data.t().contiguous(), scale_inv, self.layout)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values the FP8 bytes stand for (for tests and the unquantised wgrad)."""
        rows, k = self.data.shape
        factor = self.scale_inv
        if self.layout == ROW_BLOCKS:
            factor = factor.repeat_interleave(BLOCK, 1)[:, :k]
        elif self.layout == SQUARE_BLOCKS:
            factor = factor.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :k]
        return (self.data.float() * factor).to(dtype)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


def cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale saturated to the FP8 range and rounded to `dtype` (TE's cast, in fp32)."""
    top = fp8_max(dtype)
    return (x.float() * scale).clamp_(-top, top).to(dtype)


def current_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TE's current scaling: fp8_max / amax; 1 where amax is 0 or not finite."""
    ok = (amax > 0) & torch.isfinite(amax)
    return torch.where(ok, fp8_max(dtype) / torch.where(ok, amax, torch.ones_like(amax)),
                       torch.ones_like(amax))


def quantize_tensorwise(x2d: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> FP8Operand:
    """x2d in FP8 with one scale (delayed scaling's from the history, or the current one)."""
    scale = scale.float()
    return FP8Operand(cast(x2d, scale, dtype), scale.reciprocal(), TENSOR)


def _pow2_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """TE's blockwise scale: fp8_max / amax rounded down to a power of two (1 for amax 0)."""
    return torch.exp2(torch.floor(torch.log2(current_scale(amax, dtype))))


def _pad_to_blocks(x: torch.Tensor, dims: tuple) -> torch.Tensor:
    pad = []
    for d in (1, 0):  # F.pad lists the last dimension first
        pad += [0, (-x.shape[d]) % BLOCK if d in dims else 0]
    return torch.nn.functional.pad(x, pad)


def quantize_1x128(x2d: torch.Tensor, dtype: torch.dtype) -> FP8Operand:
    """x2d [rows, K] in FP8 with a power-of-two scale per row and 128 columns (DeepSeek-V3's
    activation and gradient tiles; TE's Float8BlockScaling, 1-D)."""
    rows, k = x2d.shape
    tiles = _pad_to_blocks(x2d.float(), (1,)).view(rows, -1, BLOCK)
    scale = _pow2_scale(tiles.abs().amax(dim=2), dtype)  # [rows, K/128]
    data = cast(tiles, scale.unsqueeze(2), dtype).view(rows, -1)[:, :k].contiguous()
    return FP8Operand(data, scale.reciprocal(), ROW_BLOCKS)


def quantize_128x128(w: torch.Tensor, dtype: torch.dtype) -> FP8Operand:
    """w [N, K] in FP8 with a power-of-two scale per 128x128 tile (DeepSeek-V3's weights)."""
    n, k = w.shape
    padded = _pad_to_blocks(w.float(), (0, 1))
    tiles = padded.view(padded.shape[0] // BLOCK, BLOCK, -1, BLOCK)
    scale = _pow2_scale(tiles.abs().amax(dim=(1, 3)), dtype)  # [N/128, K/128]
    data = cast(tiles, scale[:, None, :, None], dtype).view(padded.shape)[:n, :k].contiguous()
    return FP8Operand(data, scale.reciprocal(), SQUARE_BLOCKS)


def _column_factors(b: FP8Operand, block: int) -> torch.Tensor:
    """B's dequantisation factors inside K block `block`, one per row of B: [1, N]."""
    n = b.data.shape[0]
    if b.layout == ROW_BLOCKS:
        return b.scale_inv[:, block].reshape(1, n).contiguous()
    return b.scale_inv[:, block].repeat_interleave(BLOCK)[:n].reshape(1, n).contiguous()


def blockwise_by_rowwise_k_blocks(a: FP8Operand, b: FP8Operand,
                                  out_dtype: torch.dtype) -> torch.Tensor:
    """THE FALLBACK for blockwise scales where `_scaled_mm` has no blockwise form (the CPU):
    one rowwise-scaled `_scaled_mm` per 128-wide K block, summed in fp32."""
    k = a.data.shape[1]
    out: Optional[torch.Tensor] = None
    for block, start in enumerate(range(0, k, BLOCK)):
        cols = slice(start, min(start + BLOCK, k))
        part = torch._scaled_mm(a.data[:, cols].contiguous(), b.data[:, cols].contiguous().t(),
                                scale_a=a.scale_inv[:, block:block + 1].contiguous(),
                                scale_b=_column_factors(b, block), out_dtype=torch.float32)
        out = part if out is None else out + part
    assert out is not None, "an FP8 GEMM needs K >= 1"
    return out.to(out_dtype)


_NATIVE_BLOCKWISE: Dict[str, bool] = {}  # device type -> whether F.scaled_mm took blockwise


def _native_blockwise(a: FP8Operand, b: FP8Operand,
                      out_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """F.scaled_mm's own blockwise form (sm90 CUDA), None where this build lacks it."""
    device = a.data.device.type
    if device == "cpu" or not _NATIVE_BLOCKWISE.get(device, True):
        return None
    from torch.nn.functional import ScalingType, scaled_mm
    kinds = {ROW_BLOCKS: ScalingType.BlockWise1x128, SQUARE_BLOCKS: ScalingType.BlockWise128x128}
    # cuBLAS reads 1x128 factors outer-dimension-major: [rows, K/128] with stride (1, rows)
    sa = a.scale_inv.t().contiguous().t()
    sb = b.scale_inv.t().contiguous().t() if b.layout == ROW_BLOCKS else b.scale_inv
    try:
        out = scaled_mm(a.data, b.data.t(), sa, kinds[a.layout], sb, kinds[b.layout],
                        output_dtype=out_dtype)
    except (RuntimeError, ValueError):
        _NATIVE_BLOCKWISE[device] = False
        return None
    _NATIVE_BLOCKWISE[device] = True
    return out


def fp8_gemm(a: FP8Operand, b: FP8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """A B^T in `out_dtype` from two FP8 operands, through `torch._scaled_mm`."""
    if a.layout == TENSOR and b.layout == TENSOR:
        return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale_inv, scale_b=b.scale_inv,
                                out_dtype=out_dtype)
    if a.layout != ROW_BLOCKS or b.layout == TENSOR:
        raise ValueError(f"fp8_gemm: A in {a.layout} tiles with B in {b.layout} tiles is not "
                         f"a recipe's GEMM (blockwise: A 1x128, B 1x128 or 128x128)")
    native = _native_blockwise(a, b, out_dtype)
    return native if native is not None else blockwise_by_rowwise_k_blocks(a, b, out_dtype)
