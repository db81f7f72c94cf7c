"""Plain-torch versions of the fused ops: the fallback path and the tests' reference math.

Every function computes in float32 (or float64 when given float64) and returns the input
dtype, matching what the fused kernels do. Autograd flows through ordinary torch ops.
"""
from typing import Optional

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _same_dtype(x: torch.Tensor, *params: Optional[torch.Tensor]) -> bool:
    return all(p is None or p.dtype == x.dtype for p in params)


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float) -> torch.Tensor:
    """LayerNorm over the last dimension with fp32 statistics; output in x's dtype."""
    if x.is_cuda and _same_dtype(x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)  # fp32 statistics inside
    ct = _compute_dtype(x)
    w = None if weight is None else weight.to(ct)
    b = None if bias is None else bias.to(ct)
    return F.layer_norm(x.to(ct), (x.shape[-1],), w, b, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: x / sqrt(mean(x^2) + eps) * weight."""
    if x.is_cuda and _same_dtype(x, weight) and hasattr(F, "rms_norm"):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    ct = _compute_dtype(x)
    xc = x.to(ct)
    rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    y = xc * rstd
    if weight is not None:
        y = y * weight.to(ct)
    return y.to(x.dtype)


def _masked_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Softmax over the last dim where masked entries get zero weight; all-masked rows give 0."""
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    row_max = scores.amax(-1, keepdim=True).detach()
    # A fully masked row has max -inf: shift by 0 instead so exp gives 0, not NaN.
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    e = torch.exp(scores - row_max)
    denom = e.sum(-1, keepdim=True)
    return e / denom.clamp_min(torch.finfo(scores.dtype).tiny)


def scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor],
                          scale: float) -> torch.Tensor:
    """softmax(x * scale) with mask (bool, True = masked out) broadcast over x [b, np, sq, sk]."""
    ct = _compute_dtype(x)
    return _masked_softmax(x.to(ct) * scale, mask).to(x.dtype)


def causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """Bool [sq, sk] mask, True where key j > query i (the strict upper triangle)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(x * scale) for x [b*np, sq, sk]: query i sees keys 0..i."""
    ct = _compute_dtype(x)
    mask = causal_mask(x.shape[-2], x.shape[-1], x.device)
    return _masked_softmax(x.to(ct) * scale, mask).to(x.dtype)
