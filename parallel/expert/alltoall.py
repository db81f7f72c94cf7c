"""All-to-all token dispatch (--moe-token-dispatcher-type alltoall), as Megatron-Core's.

Expert e lives on expert-parallel rank e // (E / ep). Dispatch: permute this rank's tokens
expert-major over all E experts, exchange the counts, all-to-all the rows (variable splits),
all-gather them over the expert-tensor-parallel group when etp > 1 (each etp rank holds an
ffn slice of every local expert and computes a partial output for every row), and re-sort
the received rows, which come grouped by source rank, into local-expert-major order. Combine
undoes each step (the etp partial outputs are summed by a reduce-scatter) and applies the
router probabilities on the source rank, as `LocalDispatcher` does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.expert.collectives import all_to_all, gather_rows, reduce_scatter_rows
from gigatron.parallel.expert.dispatch import Dispatched, permute, unpermute


@dataclass
class _Plan:
    """Row counts of one dispatch, on the host (the all-to-all needs its split sizes there)."""

    input_splits: List[int]
    """rows this rank sends to each ep rank"""
    output_splits: List[int]
    """rows this rank receives from each ep rank"""
    etp_sizes: List[int]
    """rows each etp rank received (the blocks of the etp all-gather)"""
    chunk_sizes: List[int]
    """received rows per (etp rank, source ep rank, local expert), in arrival order"""
    sorted_order: List[int]
    """chunk indices in local-expert-major order"""


def _reorder(rows: torch.Tensor, sizes: List[int], order: List[int]) -> torch.Tensor:
    """Chunks of `rows` (lengths `sizes`) concatenated in `order`."""
    if order == sorted(order):
        return rows
    chunks = rows.split(sizes)
    return torch.cat([chunks[i] for i in order])


class AllToAllDispatcher:
    """Sends each token to the ep ranks of its experts with one all-to-all, and back.

    `ep_group` is this layer's expert-parallel group, `etp_group` its expert-tensor-parallel
    group (None: etp 1). Ranks may bring different numbers of tokens. The host reads the
    token counts once per dispatch: all_to_all_single needs its split sizes on the host
    (Megatron-Core synchronises at the same point); nothing else leaves the device.
    """

    def __init__(self, ep_group: Group, num_experts: int, etp_group: Group = None) -> None:
        self.ep_group, self.etp_group = ep_group, etp_group
        self.ep = comm.group_size(ep_group)
        self.etp = 1 if etp_group is None else comm.group_size(etp_group)
        if num_experts % self.ep:
            raise ValueError(f"--num-experts {num_experts} is not divisible by "
                             f"--expert-model-parallel-size {self.ep}: each expert-parallel "
                             f"rank holds num_experts / ep experts")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep
        self.first_expert = comm.group_rank(ep_group) * self.num_local_experts

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        """This rank's rows for its local experts, local-expert-major (contract: dispatch.py)."""
        rows, token_indices, counts = permute(hidden, routing_map)
        plan, tokens_per_expert = self._plan(counts)
        rows = all_to_all(rows, plan.output_splits, plan.input_splits, self.ep_group)
        if self.etp > 1:
            rows = gather_rows(rows, plan.etp_sizes, self.etp_group)
        rows = _reorder(rows, plan.chunk_sizes, plan.sorted_order)
        return Dispatched(rows, tokens_per_expert, (probs, routing_map, token_indices, plan))

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Expert outputs back to their tokens' ranks, weighted by the router probabilities."""
        probs, routing_map, token_indices, plan = dispatched.state
        sorted_sizes = [plan.chunk_sizes[i] for i in plan.sorted_order]
        arrival = sorted(range(len(plan.sorted_order)), key=plan.sorted_order.__getitem__)
        rows = _reorder(expert_output, sorted_sizes, arrival)
        if self.etp > 1:
            rows = reduce_scatter_rows(rows, plan.etp_sizes, self.etp_group)
        rows = all_to_all(rows, plan.input_splits, plan.output_splits, self.ep_group)
        return unpermute(rows, probs, routing_map, token_indices)

    def _plan(self, counts: torch.Tensor) -> tuple[_Plan, torch.Tensor]:
        """Exchange the per-expert counts over ep (and etp); one host read of what the
        collectives need. Returns the plan and tokens per local expert (on the device)."""
        ep, etp, local = self.ep, self.etp, self.num_local_experts
        everyone = counts.new_empty(ep * self.num_experts)
        comm.all_gather(everyone, counts, self.ep_group)
        if etp > 1:
            gathered = everyone.new_empty(etp * everyone.numel())
            comm.all_gather(gathered, everyone, self.etp_group)
            everyone = gathered
        # [etp rank, source ep rank, local expert]: rows arriving here, in arrival order
        mine = everyone.view(etp, ep, self.num_experts)[
            :, :, self.first_expert:self.first_expert + local]
        host = torch.cat([counts.view(ep, local).sum(1), mine.reshape(-1)]).tolist()
        input_splits, chunk_sizes = host[:ep], host[ep:]
        per_source = [sum(chunk_sizes[i:i + local]) for i in range(0, len(chunk_sizes), local)]
        etp_sizes = [sum(per_source[q * ep:(q + 1) * ep]) for q in range(etp)]
        etp_rank = 0 if self.etp_group is None else comm.group_rank(self.etp_group)
        plan = _Plan(input_splits=input_splits,
                     output_splits=per_source[etp_rank * ep:(etp_rank + 1) * ep],
                     etp_sizes=etp_sizes, chunk_sizes=chunk_sizes,
                     sorted_order=[source * local + expert for expert in range(local)
                                   for source in range(etp * ep)])
        return plan, mine.sum(dim=(0, 1))
