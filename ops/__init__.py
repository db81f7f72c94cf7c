"""Fused ops: compiled CUDA kernels when present, else Apex, else plain torch.

`layer_norm`, `rms_norm`, `scaled_masked_softmax` and `scaled_upper_triang_masked_softmax`
are the stable entry points the model calls; `chosen_backend(op, x)` says which
implementation runs, GIGATRON_OPS_BACKEND forces one, `python -m gigatron.ops` reports.
"""
from gigatron.ops.backend import chosen_backend  # noqa: F401
from gigatron.ops.fused import (  # noqa: F401
    layer_norm,
    rms_norm,
    scaled_masked_softmax,
    scaled_upper_triang_masked_softmax,
)

__all__ = ["layer_norm", "rms_norm", "scaled_masked_softmax",
           "scaled_upper_triang_masked_softmax", "chosen_backend"]
