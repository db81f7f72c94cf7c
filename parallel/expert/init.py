"""Parallelism-invariant initialisation of expert weights (parallel/tensor/init.py's way).

An expert-parallel weight is one rank's box of a full stacked tensor ([E, h, 2f] or
[E, f, h]): its experts (dim 0, split over ep) and its slice of each expert's ffn (split over
etp; SwiGLU's gate and up halves each sliced). The full tensor is drawn from the (seed,
name) generator and this rank keeps its box, so every ep/etp/tp/pp layout holds the same
full model as one device.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

from gigatron.parallel.tensor.init import Stride, full_tensor, shard

# (dim, rank, size, stride): one split of a full tensor, applied in order
Split = Tuple[int, int, int, Stride]


def mark_expert_parallel(param: torch.Tensor, splits: Sequence[Split]) -> None:
    """Tag an expert weight: held as its box `splits` of the full tensor, its grads reduced
    over the expert-data-parallel group (not replicated over tp: parallel/zero reads this)."""
    setattr(param, "expert_parallel", True)
    setattr(param, "expert_splits", tuple(splits))


def expert_box(full: torch.Tensor, splits: Sequence[Split]) -> torch.Tensor:
    """This rank's box of the full tensor."""
    for dim, rank, size, stride in splits:
        full = shard(full, dim, rank, size, stride)
    return full


@torch.no_grad()
def initialize_expert_parameter(param: torch.nn.Parameter, seed: int, name: str) -> None:
    """Fill an expert weight with its box of the name-seeded full tensor (no-op on meta)."""
    if param.is_meta:
        return
    full = full_tensor(getattr(param, "init_spec"), seed, name)
    param.copy_(expert_box(full, getattr(param, "expert_splits")).to(dtype=param.dtype))
