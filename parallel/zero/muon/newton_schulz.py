"""Muon's update rule on one matrix: Newton-Schulz orthogonalisation and the update's scale.

The polynomial iteration X <- a X + (b A + c A^2) X with A = X X^T (X normalised to Frobenius
norm 1, so its spectral norm is at most 1) drives every singular value towards 1: X becomes
about U V^T for X = U S V^T. The coefficient sets are the ones Megatron-Core's Muon takes from
NVIDIA's emerging_optimizers (names and numbers as there: "simple" is Keller Jordan's and
torch.optim.Muon's, "quintic" modded-nanogpt's five, "polar_express" arXiv:2505.16932's eight,
"aol" flash-newton-schulz's four). Wide-side first: a tall matrix is iterated as its transpose
(the Gram matrix is the smaller one), which changes nothing in exact arithmetic.

Precision (Megatron-LM's --muon-fp32-matmul-prec): "medium" runs the iteration in bf16 after
normalising in fp32 (emerging_optimizers' "bf16 compute" path, as torch.optim.Muon runs bf16
too); "high" keeps fp32 with torch's float32 matmul precision "high" (TF32 where the device
has it); "highest" is full fp32 everywhere.
"""
from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group

Coefficients = Tuple[float, float, float]

COEFFICIENT_SETS: Dict[str, Tuple[Coefficients, ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
                (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
                (2.8366, -3.0525, 1.2012)),
    "polar_express": ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184),
                      (3.9096, -2.8234, 0.5250), (3.2856, -2.4153, 0.4853),
                      (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                      (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)),
    "aol": ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959),
            (2.7573, -3.2939, 1.4254), (2.7215, -3.0494, 1.3169)),
}
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")
MATMUL_PRECISIONS = ("medium", "high", "highest")
EPS = 1e-7


def coefficient_problem(kind: str, steps: int) -> str:
    """Why `steps` iterations of set `kind` cannot run ('' when they can)."""
    if kind not in COEFFICIENT_SETS:
        return f"unknown coefficient type {kind!r}: use one of {', '.join(COEFFICIENT_SETS)}"
    if steps < 1:
        return f"needs at least 1 Newton-Schulz step, got {steps}"
    n = len(COEFFICIENT_SETS[kind])
    if kind == "polar_express" and steps < n:
        return f"polar_express needs at least {n} steps (its set has {n}), got {steps}"
    if kind not in ("simple", "polar_express") and steps % n:
        return f"{kind} needs a multiple of {n} steps (its set has {n}), got {steps}"
    return ""


def coefficients(kind: str, steps: int) -> List[Coefficients]:
    """The (a, b, c) of every step: "simple" repeats its one set, "polar_express" repeats its
    last, the others cycle through theirs (emerging_optimizers' rules)."""
    problem = coefficient_problem(kind, steps)
    if problem:
        raise ValueError(f"Muon: {problem}")
    sets = list(COEFFICIENT_SETS[kind])
    if kind == "polar_express":
        return sets + [sets[-1]] * (steps - len(sets))
    return (sets * steps)[:steps] if kind == "simple" else sets * (steps // len(sets))


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest" if precision == "medium" else precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def newton_schulz(x: torch.Tensor, steps: int = 5, kind: str = "quintic",
                  precision: str = "medium", eps: float = EPS, distributed: bool = False,
                  group: Group = None, tall: Optional[bool] = None) -> torch.Tensor:
    """The orthogonalised fp32 form of `x` ([m, n] or a stack [k, m, n] of matrices, each on
    its own). `distributed`: `x` is this rank's columns of the matrix (of its transpose with
    `tall`) and the norm and every Gram matrix are summed over `group` (Megatron-Core's
    'distributed' tensor-parallel mode)."""
    if x.dim() not in (2, 3):
        raise ValueError(f"Newton-Schulz orthogonalises matrices, got shape {tuple(x.shape)}")
    sets = coefficients(kind, steps)
    x = x.float()
    tall = x.size(-2) > x.size(-1) if tall is None else tall
    if tall:
        x = x.mT
    squares = x.square().sum(dim=(-2, -1), keepdim=True)
    if distributed:
        comm.all_reduce(squares, group=group)
    X = x / squares.sqrt().clamp(min=eps)
    if precision == "medium":
        X = X.to(torch.bfloat16)
    with _matmul_precision(precision):
        for a, b, c in sets:
            X = _step(X, a, b, c, distributed, group)
    X = X.float()
    return X.mT if tall else X


def _step(X: torch.Tensor, a: float, b: float, c: float, distributed: bool = False,
          group: Group = None) -> torch.Tensor:
    A = X @ X.mT
    if distributed:
        comm.all_reduce(A, group=group)
    if X.dim() == 2:
        B = torch.addmm(A, A, A, beta=b, alpha=c)
        return torch.addmm(X, B, X, beta=a)
    B = torch.baddbmm(A, A, A, beta=b, alpha=c)
    return torch.baddbmm(X, B, X, beta=a)


def scale_factor(rows: int, cols: int, mode: str = "spectral") -> float:
    """The factor of an orthogonalised [rows (out), cols (in)] update: "spectral"
    sqrt(max(rows, cols)) (Kimi/Moonlight's, lr transfers from AdamW with 0.2 extra),
    "shape_scaling" sqrt(max(1, rows/cols)) (Keller Jordan's, torch.optim.Muon's default),
    "unit_rms_norm" sqrt(rows/cols)."""
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"Muon scale mode {mode!r}: use one of {', '.join(SCALE_MODES)}")


def newton_schulz_flops(rows: int, cols: int, steps: int) -> int:
    """Multiply-add FLOPs (2 per multiply-add) of `steps` iterations on one [rows, cols]
    matrix: per step the Gram matrix (2 m^2 n), A^2 (2 m^3) and B X (2 m^2 n), m the smaller
    side."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


def split_rows(rows: int, split: Sequence[int]) -> int:
    """Query groups in a fused [groups x sum(split), cols] matrix (raises when not whole)."""
    if rows % sum(split):
        raise ValueError(f"Muon: a fused qkv weight of {rows} rows does not split into query "
                         f"groups of {list(split)} rows")
    return rows // sum(split)
