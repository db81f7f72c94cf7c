"""Apex's fused norms as the middle choice, used only when apex is importable (never installed)."""
import functools
from types import SimpleNamespace
from typing import Optional, Tuple

import torch


@functools.lru_cache(maxsize=None)
def load_apex() -> Tuple[Optional[SimpleNamespace], str]:
    """(apex norm functions, note) or (None, why not)."""
    try:
        from apex.normalization.fused_layer_norm import (  # type: ignore
            FusedLayerNormAffineFunction,
            FusedRMSNormAffineFunction,
        )
    except Exception as exc:  # ImportError, or apex built without its CUDA extensions
        return None, f"apex not importable ({type(exc).__name__}: {exc})"
    return (SimpleNamespace(layer_norm=FusedLayerNormAffineFunction, rms_norm=FusedRMSNormAffineFunction),
            "apex.normalization importable")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Apex fused LayerNorm (weight and bias cast to x's dtype, as apex expects)."""
    apex, why = load_apex()
    if apex is None:
        raise RuntimeError(why)
    return apex.layer_norm.apply(x, weight.to(x.dtype), bias.to(x.dtype), (x.shape[-1],), eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Apex fused RMSNorm."""
    apex, why = load_apex()
    if apex is None:
        raise RuntimeError(why)
    return apex.rms_norm.apply(x, weight.to(x.dtype), (x.shape[-1],), eps)
