"""Global gradient norm computed once, correctly (DESIGN decision 7).

Each rank sums the squares of the gradient elements it is responsible for: parameters
replicated across tp are counted on tp rank 0 only, the tied embedding on the first pipeline
stage only, and (stage 0, where every dp rank holds the same reduced grads) dp rank 0 only;
shards over tp, pp and dp are all counted. One all-reduce over all ranks then gives the
norm, together with a count of non-finite values for the fp16 overflow check.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch

from gigatron.parallel import comm


def counts_in_norm(param: torch.nn.Parameter, tp_rank: int, pp_rank: int) -> bool:
    """Whether this rank's copy of `param` contributes to the global norm."""
    if getattr(param, "shared_embedding", False) and pp_rank != 0:
        return False  # the last stage's tied copy: the first stage counts it
    if not getattr(param, "tensor_model_parallel", False) and tp_rank != 0:
        return False  # identical on every tp rank: count it once
    return True


def global_norm_and_overflow(norm_views: Iterable[torch.Tensor],
                             check_views: Iterable[torch.Tensor], group=None,
                             device: Optional[torch.device] = None) -> Tuple[float, bool]:
    """(L2 norm of all counted grads over `group`, whether any rank has a non-finite grad)."""
    sumsq = torch.zeros((), dtype=torch.float32, device=device)
    nonfinite = torch.zeros((), dtype=torch.float32, device=device)
    for v in norm_views:
        sumsq += v.float().pow(2).sum()
    for v in check_views:
        nonfinite += (~torch.isfinite(v)).sum()
    terms = torch.stack([sumsq, nonfinite])
    comm.all_reduce(terms, group=group)
    total, bad = terms.tolist()
    overflow = bad > 0 or not math.isfinite(total)
    return (math.sqrt(total) if not overflow else float("inf")), overflow


def clip_coefficient(norm: float, max_norm: float) -> float:
    """Factor to scale grads by so their norm is at most `max_norm` (torch's convention)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))
