"""DeepSpeed's Muon (its `"optimizer": {"type": "Muon"}`), as an update rule of the ZeRO optimizer.

What DeepSpeed 0.19.8 means by Muon, where it differs from Megatron-Core's (newton_schulz.py):
- Keller Jordan's iteration: the "simple" coefficients (3.4445, -4.7750, 2.0315), 5 steps,
  the input divided by (its Frobenius norm + 1e-7), a tall matrix iterated as its transpose.
  `ns_method` "standard" runs it in bf16 (cast before the normalisation), "gram" (the
  default) iterates on the Gram matrix R = X X^T with a restart at step 2 (Tri Dao's Gram
  Newton-Schulz: the same polynomial, fewer FLOPs for wide matrices, a square one takes the
  standard loop), normalised in fp32 then run in fp16 where the device has fp16 matmuls,
  else in fp32 (a CPU without AVX512-FP16).
- The update is scaled by sqrt(max(1, rows / cols)) ("shape_scaling"), nesterov always.
- Its matrices: a 2-D tensor as stored [rows, cols]; a 3-D one as that many [rows, cols]
  matrices (a batch, each on its own); a 4-D one (conv) as [out, everything else], scaled by
  its last two dimensions (as DeepSpeed computes it).
- The momentum does not take a non-finite gradient (it keeps its value; the step is then
  skipped or carries the non-finite values into the norm, as DeepSpeed's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import torch

from gigatron.parallel.zero.muon.matrices import MatrixUnit

NS_METHODS = ("gram", "standard")
SIMPLE = (3.4445, -4.7750, 2.0315)
STEPS = 5
GRAM_RESTART = 2
EPS = 1e-7


def compute_dtype(method: str, device: torch.device) -> torch.dtype:
    """The dtype the iteration runs in: DeepSpeed's accelerator rule for its device kind."""
    if method == "gram":
        return torch.float16 if _fp16_matmuls(device) else torch.float32
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16


def _fp16_matmuls(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    try:  # DeepSpeed's CPU accelerator asks oneDNN
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:  # noqa: BLE001 - torch builds without oneDNN
        return False


def newton_schulz(g: torch.Tensor, method: str = "gram", steps: int = STEPS) -> torch.Tensor:
    """DeepSpeed's orthogonalisation of `g` ([..., m, n]) in its compute dtype."""
    if method not in NS_METHODS:
        raise ValueError(f"Muon ns_method must be one of {', '.join(NS_METHODS)}, got "
                         f"{method!r}")
    dtype = compute_dtype(method, g.device)
    tall = g.size(-2) > g.size(-1)
    if method == "standard":
        x = g.to(dtype)
        x = x.mT if tall else x
        x = x / (x.norm(dim=(-2, -1), keepdim=True) + EPS)
        out = _standard(x, steps)
        return out.mT if tall else out
    x = g.to(torch.float32 if g.dtype == torch.float16 else g.dtype)
    x = x.mT if tall else x
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + EPS)).to(dtype)
    if x.size(-1) <= x.size(-2):  # square: no saving, the standard loop
        out = _standard(x, steps)
        return out.mT if tall else out
    q, x = _gram(x, steps)
    return x.mT @ q.mT if tall else q @ x


def _standard(x: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = SIMPLE
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x


def _gram(x: torch.Tensor, steps: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(Q, X) with Q X the iterate: the polynomial is applied to R = X X^T only, so a step
    costs m^3, not m^2 n; X is restarted once as Q X, which bounds half-precision drift."""
    a, b, c = SIMPLE
    r, q = x @ x.mT, None
    for i in range(steps):
        if i == GRAM_RESTART:
            assert q is not None
            x = q @ x
            r, q = x @ x.mT, None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != GRAM_RESTART:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    assert q is not None
    return q, x


@dataclass(frozen=True)
class DeepSpeedMatrix(MatrixUnit):
    """A matrix of DeepSpeed's Muon with the shape its scale reads."""

    scale_rows: int = 1
    scale_cols: int = 1


def scale(rows: int, cols: int) -> float:
    """sqrt(max(1, rows / cols))."""
    return (rows / cols) ** 0.5 if rows > cols else 1.0


def deepspeed_units(params: Sequence[torch.Tensor]) -> List[MatrixUnit]:
    """Every matrix of `params` (a flat group's, all Muon's) by DeepSpeed's rule."""
    units: List[MatrixUnit] = []
    for index, p in enumerate(params):
        shape = tuple(p.shape)
        if len(shape) == 3:
            n, rows, cols = shape
            units += [DeepSpeedMatrix(index, e * rows * cols, rows, cols,
                                      scale_rows=rows, scale_cols=cols) for e in range(n)]
        elif len(shape) >= 2:
            rows = shape[0]
            units.append(DeepSpeedMatrix(index, 0, rows, p.numel() // rows,
                                         scale_rows=shape[-2], scale_cols=shape[-1]))
        else:
            raise ValueError(f"Muon (use_muon) needs tensors of 2 or more dimensions, got "
                             f"shape {list(shape)}")
    return units


class DeepSpeedUpdate:
    """Orthogonalise-and-scale one matrix the way DeepSpeed's muon_update does."""

    def __init__(self, method: str = "gram") -> None:
        self.method = method

    def __call__(self, unit: MatrixUnit, matrix: torch.Tensor) -> torch.Tensor:
        assert isinstance(unit, DeepSpeedMatrix)
        out = newton_schulz(matrix, self.method)
        out *= scale(unit.scale_rows, unit.scale_cols)
        return out.to(matrix.dtype)
