"""The public fused ops: each picks kernel -> Apex -> torch (see backend.py) and runs it."""
from typing import Optional

import torch

from gigatron.ops import apex_backend, reference
from gigatron.ops.backend import chosen_backend
from gigatron.ops.build import load_kernels
from gigatron.ops.kernel_functions import FusedNormFunction, FusedSoftmaxFunction


def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the last dim (fp32 statistics, output in x's dtype)."""
    backend = chosen_backend("layer_norm", x, weight)
    if backend == "kernel":
        return FusedNormFunction.apply(x, weight, bias, eps, False, load_kernels()[0])
    if backend == "apex" and weight is not None and bias is not None:
        return apex_backend.layer_norm(x, weight, bias, eps)
    return reference.layer_norm(x, weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float = 1e-5) -> torch.Tensor:
    """RMSNorm over the last dim (fp32 statistics, output in x's dtype)."""
    backend = chosen_backend("rms_norm", x, weight)
    if backend == "kernel":
        return FusedNormFunction.apply(x, weight, None, eps, True, load_kernels()[0])
    if backend == "apex" and weight is not None:
        return apex_backend.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def _check_softmax_input(name: str, x: torch.Tensor, dims: int, mask: Optional[torch.Tensor]) -> None:
    if x.dim() != dims:
        shape = "[b, np, sq, sk]" if dims == 4 else "[b*np, sq, sk]"
        raise ValueError(f"{name}: x must be {shape}, got shape {tuple(x.shape)}")
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"{name}: mask must be a bool tensor (True = masked out), got {mask.dtype}")
    try:
        torch.broadcast_shapes(mask.shape, x.shape)
    except RuntimeError:
        raise ValueError(f"{name}: mask shape {tuple(mask.shape)} does not broadcast to x "
                         f"{tuple(x.shape)}") from None


def scaled_masked_softmax(x: torch.Tensor, mask: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """softmax(x * scale) over sk for x [b, np, sq, sk]; mask True = masked; all-masked rows give 0."""
    _check_softmax_input("scaled_masked_softmax", x, 4, mask)
    if chosen_backend("scaled_masked_softmax", x) == "kernel":
        return FusedSoftmaxFunction.apply(x, mask, float(scale), False, load_kernels()[0])
    return reference.scaled_masked_softmax(x, mask, scale)


def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(x * scale) for x [b*np, sq, sk]: query i attends to keys 0..i."""
    _check_softmax_input("scaled_upper_triang_masked_softmax", x, 3, None)
    if chosen_backend("scaled_upper_triang_masked_softmax", x) == "kernel":
        return FusedSoftmaxFunction.apply(x, None, float(scale), True, load_kernels()[0])
    return reference.scaled_upper_triang_masked_softmax(x, scale)
