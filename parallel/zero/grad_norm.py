"""Global gradient norm computed once, correctly.

Each rank sums the squares of the gradient elements it is responsible for: parameters
replicated across tp are counted on tp rank 0 only, the tied embedding on the first pipeline
stage only, and (stage 0, where every dp rank holds the same reduced grads) dp rank 0 only;
shards over tp, pp and dp are all counted. Expert weights (expert parallelism) differ across
tp, ep and etp ranks and are replicated only over the expert-data-parallel group: counted on
every rank, at stage 0 on its edp rank 0 only. One all-reduce over all ranks then gives the
norm, together with a count of non-finite values for the fp16 overflow check; both stay
on the device.

The sum of squares takes one multi-tensor kernel per (device, dtype) group
(`torch._foreach_norm`, accumulating in fp32 even for bf16/fp16 grads, in fp64 on CPU) and
then squares the per-tensor norms, instead of a pow and a sum kernel per tensor (issue 33).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group


def counts_in_norm(param: torch.nn.Parameter, tp_rank: int, pp_rank: int) -> bool:
    """Whether this rank's copy of `param` contributes to the global norm."""
    if getattr(param, "shared_embedding", False) and pp_rank != 0:
        return False  # the last stage's tied copy: the first stage counts it
    if getattr(param, "expert_parallel", False):
        return True  # each rank holds other experts (or expert slices) than its tp peers
    if not getattr(param, "tensor_model_parallel", False) and tp_rank != 0:
        return False  # identical on every tp rank: count it once
    return True


def global_norm_and_nonfinite(norm_views: Iterable[torch.Tensor],
                              check_views: Iterable[torch.Tensor] = (), group: Group = None,
                              device: Optional[torch.device] = None
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(L2 norm of all counted grads over `group`, count of non-finite elements in
    `check_views` on any rank) as 0-dim device tensors: one all-reduce, no host read."""
    terms = torch.zeros(2, dtype=torch.float32, device=device)
    for views in _by_device_and_dtype(norm_views).values():
        terms[0] += _sum_of_squares(views)
    for v in check_views:
        terms[1] += (~torch.isfinite(v)).sum()
    comm.all_reduce(terms, group=group)
    return terms[0].sqrt(), terms[1]


def count_zeros(views: Iterable[torch.Tensor], group: Group = None,
                device: Optional[torch.device] = None) -> torch.Tensor:
    """Number of zero elements in the counted grad `views` over `group` (Megatron's
    --log-num-zeros-in-grad "num zeros"), a 0-dim float64 device tensor: one all-reduce, no
    host read; the counting rule is the norm's, so each element of the model counts once."""
    zeros = torch.zeros((), dtype=torch.float64, device=device)
    for v in views:
        zeros += (v == 0).sum()
    comm.all_reduce(zeros, group=group)
    return zeros


def _by_device_and_dtype(views: Iterable[torch.Tensor]
                         ) -> Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]:
    """Views grouped so that each group can go through one multi-tensor kernel."""
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for v in views:
        groups.setdefault((v.device, v.dtype), []).append(v)
    return groups


def _sum_of_squares(views: List[torch.Tensor]) -> torch.Tensor:
    """fp32 sum of the squares of all elements of same-device, same-dtype `views`."""
    norms = torch._foreach_norm(views, 2, dtype=_accumulation_dtype(views[0]))
    return torch.stack(norms).square().sum().float()


def _accumulation_dtype(view: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 grads (without dtype= bf16 norms would come back in bf16)."""
    # CPU's norm kernel adds up sequentially (1.5e-5 relative off for 200k fp32 elements,
    # where the old pow().sum() summed pairwise): fp64 there keeps the old accuracy; the
    # kernel may not narrow, so fp64 grads stay fp64
    if view.device.type == "cpu" or view.dtype == torch.float64:
        return torch.float64
    return torch.float32


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Factor to scale grads by so their norm is at most `max_norm` (torch's convention),
    computed on the norm's device so no host read decides it."""
    if max_norm <= 0:
        return torch.ones_like(norm)
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)
