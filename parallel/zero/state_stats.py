"""Norms of the optimizer state over the whole model (Megatron-DeepSpeed's
--log-optimizer-states-to-tensorboard series).

Twelve numbers, named as Megatron-DeepSpeed names them: the L2 and L1 norms and the largest
absolute value of Adam's second moment (`variance`), of its square root (`variance_sqrt`), of
its first moment (`momentum`) and of the fp32 master weights (`weight`). Each rank reads the
elements of its own master shard (ZeRO stage >= 1 shards are disjoint over dp), counting every
element of the full model once, by the rule of the gradient norm (`grad_norm.counts_in_norm`:
tp-replicated parameters on tp rank 0, the tied embedding on the first stage, stage-0 copies on
dp rank 0). Megatron-DeepSpeed sums its per-rank values over tp and pp without that rule, so a
replicated LayerNorm counts tp times there; here it counts once, as the model has it once.
Optimizers without Adam's moments (SGD) report the weight series only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.zero.grad_norm import counts_in_norm
from gigatron.parallel.zero.layout import shard_overlaps

if TYPE_CHECKING:
    from gigatron.parallel.zero.optimizer import ZeroOptimizer

SERIES = ("variance", "variance_sqrt", "momentum", "weight")


def _counted_ranges(zero: "ZeroOptimizer", group_index: int) -> List[Tuple[int, int]]:
    """(start, length) in the master shard of flat group `group_index` of every piece this
    rank counts (the same for every master-shaped tensor of the group)."""
    g = zero.flat_groups[group_index]
    pg = zero.process_groups
    counts = [counts_in_norm(p, pg.tp_rank, pg.pp_rank) for p in g.params]
    return [(b.shard_offset + start, length) for b in g.buckets
            for idx, _, start, length in shard_overlaps(b, g.numels, g.rank_in_shard)
            if counts[idx]]


def _series_tensors(zero: "ZeroOptimizer", master: torch.Tensor
                    ) -> Dict[str, Optional[torch.Tensor]]:
    state = zero.optimizer.state.get(master, {})
    v, m = state.get("exp_avg_sq"), state.get("exp_avg")
    return {"variance": v, "variance_sqrt": None if v is None else v.sqrt(),
            "momentum": m, "weight": master}


def optimizer_state_stats(zero: "ZeroOptimizer") -> Dict[str, float]:
    """Collective over every rank: {'<series>_l2', '<series>_l1', '<series>_abs_max'} of the
    whole model's optimizer state (series missing from the optimizer are left out). Sums stay
    on the parameters' device until the one read after the reductions."""
    device = zero.flat_groups[0].device if zero.flat_groups else torch.device("cpu")
    n = len(SERIES)
    sums = torch.zeros(2 * n, dtype=torch.float64, device=device)  # l2^2, l1 per series
    maxes = torch.zeros(n, dtype=torch.float64, device=device)
    present = torch.zeros(n, dtype=torch.float64, device=device)
    stage0_copy = zero.stage == 0 and any(g.dp_rank != 0 for g in zero.flat_groups)
    for gi, g in enumerate(zero.flat_groups):
        ranges = [] if stage0_copy else _counted_ranges(zero, gi)
        for si, tensor in enumerate(_series_tensors(zero, g.master).values()):
            if tensor is None:
                continue
            present[si] = 1
            for start, length in ranges:
                x = tensor[start:start + length].detach().to(device=device, dtype=torch.float64)
                sums[2 * si] += x.pow(2).sum()
                sums[2 * si + 1] += x.abs().sum()
                if x.numel():
                    maxes[si] = torch.maximum(maxes[si], x.abs().max())
    comm.all_reduce(sums)
    comm.all_reduce(maxes, op=torch.distributed.ReduceOp.MAX)
    comm.all_reduce(present, op=torch.distributed.ReduceOp.MAX)
    values = torch.cat([sums, maxes, present]).tolist()
    out: Dict[str, float] = {}
    for si, name in enumerate(SERIES):
        if values[3 * n + si] > 0:
            out[f"{name}_l2"] = values[2 * si] ** 0.5
            out[f"{name}_l1"] = values[2 * si + 1]
            out[f"{name}_abs_max"] = values[2 * n + si]
    return out
