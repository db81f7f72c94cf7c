"""Autograd wrappers around the compiled kernels (forward saves what backward needs)."""
from types import ModuleType
from typing import Any, Optional, Tuple

import torch

NORM_VARIANTS = (7, 4)
"""Launch variants (csrc/norm_variants.cuh) the norm kernels run, forward and backward: the
fastest over the six bf16 LayerNorm/RMSNorm shapes of the H100 sweep (`bench_kernels.py
--sweep-norms`, bench/results/2026-11-26-h100/kernel_sweep.json), 1.27x and 1.17x variant 0
(geometric means; each checked against fp64 there by tests/test_ops_cuda.py). Variants
apply to bf16 rows only: other dtypes, and rows a variant does not fit, run variant 0."""


class FusedNormFunction(torch.autograd.Function):
    """LayerNorm (rms=False) or RMSNorm (rms=True); saves x, mean and rstd for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                eps: float, rms: bool, kernels: ModuleType) -> torch.Tensor:
        y, mean, rstd = kernels.norm_forward(x, weight, bias, eps, rms, NORM_VARIANTS[0])
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.rms, ctx.kernels = rms, kernels
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, weight, mean, rstd = ctx.saved_tensors
        has_bias = ctx.bias_dtype is not None
        dx, dweight, dbias = ctx.kernels.norm_backward(dy.contiguous(), x, weight, mean, rstd,
                                                       ctx.rms, has_bias, NORM_VARIANTS[1])
        dbias = dbias.to(ctx.bias_dtype) if has_bias else None
        return dx.view(x.shape), dweight.to(weight.dtype), dbias, None, None, None


class FusedSoftmaxFunction(torch.autograd.Function):
    """softmax(x * scale) with a bool mask or the causal mask; saves the output for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                causal: bool, kernels: ModuleType) -> torch.Tensor:
        y = kernels.softmax_forward(x, mask, scale, causal)
        ctx.save_for_backward(y)
        ctx.scale, ctx.causal, ctx.kernels = scale, causal, kernels
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        (y,) = ctx.saved_tensors
        dx = ctx.kernels.softmax_backward(dy.contiguous(), y, ctx.scale, ctx.causal)
        return dx, None, None, None, None
