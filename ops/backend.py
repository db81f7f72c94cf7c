"""Which implementation runs each op: compiled kernel -> Apex -> plain torch, or a forced one.

GIGATRON_OPS_BACKEND=auto|kernel|apex|torch (default auto) forces the choice; forcing a
backend that cannot take the input raises a ValueError that says why.
"""
import os
from typing import Optional

import torch

from gigatron.ops.apex_backend import load_apex
from gigatron.ops.build import load_kernels

ENV_VAR = "GIGATRON_OPS_BACKEND"
CHOICES = ("auto", "kernel", "apex", "torch")
OPS = ("layer_norm", "rms_norm", "scaled_masked_softmax", "scaled_upper_triang_masked_softmax")
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
APEX_OPS = ("layer_norm", "rms_norm")


def requested_backend() -> str:
    """The backend asked for through GIGATRON_OPS_BACKEND (validated)."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r} is not one of {', '.join(CHOICES)}")
    return value


def kernel_problem(op: str, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why the compiled kernel cannot run `op` on this input, or None if it can."""
    if not x.is_cuda:
        return f"input is on {x.device.type}, the kernels need CUDA tensors"
    if x.dtype not in KERNEL_DTYPES:
        return f"dtype {x.dtype} is not float32/float16/bfloat16"
    if op in ("layer_norm", "rms_norm") and weight is None:
        return "the kernels need a weight (elementwise affine)"
    module, note = load_kernels()
    return None if module is not None else note


def apex_problem(op: str, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why Apex cannot run `op` on this input, or None if it can."""
    if op not in APEX_OPS:
        return ("apex's fused softmax is not used: it gives uniform weights, not zeros, on "
                "fully masked rows and limits sk")
    if not x.is_cuda:
        return f"input is on {x.device.type}"
    if weight is None:
        return "apex's affine norms need a weight"
    module, note = load_apex()
    return None if module is not None else note


def chosen_backend(op: str, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> str:
    """The backend that will run `op` on `x`: 'kernel', 'apex' or 'torch'."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; ops are {', '.join(OPS)}")
    requested = requested_backend()
    if requested == "torch":
        return "torch"
    if requested in ("auto", "kernel"):
        why = kernel_problem(op, x, weight)
        if why is None:
            return "kernel"
        if requested == "kernel":
            raise ValueError(f"{ENV_VAR}=kernel but {op} cannot use the compiled kernel: {why}; "
                             f"unset {ENV_VAR} to fall back")
    if requested in ("auto", "apex"):
        why = apex_problem(op, x, weight)
        if why is None:
            return "apex"
        if requested == "apex":
            raise ValueError(f"{ENV_VAR}=apex but {op} cannot use apex: {why}; unset {ENV_VAR} to fall back")
    return "torch"
