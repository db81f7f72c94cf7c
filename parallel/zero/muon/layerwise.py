"""Whole matrices over ZeRO's shards: Megatron-Core's layer-wise distributed Muon.

ZeRO (stages 1-3) gives each data-parallel rank one contiguous range of a flat group, which
cuts matrices anywhere; Newton-Schulz needs each matrix whole. So every matrix gets an owner
rank, balanced by its Newton-Schulz cost (largest first to the least loaded rank), and a step
runs: the momentum update on each rank's own shard (element-wise, the momentum stays
sharded), one all-to-all sending each owner the pieces of its matrices, the owners'
orthogonalisations, one all-to-all sending every piece of the updates back to the rank whose
shard holds it. Each rank sends and receives about its shard's size twice (Megatron-Core's
layer-wise optimizer all-reduces the gradients instead of reduce-scattering them and
all-gathers the parameters: about one shard x dp more). Stage 0 (no shards) orthogonalises
every matrix on every rank, as torch DDP with torch.optim.Muon does.

The plan is pure layout math (tests/test_muon.py checks it without processes): the pieces
of rank r's shard are `shard_overlaps` of the flat group's buckets, cut where matrices start.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.zero.layout import Bucket, shard_overlaps
from gigatron.parallel.zero.muon.matrices import MatrixUnit

# (matrix index, start within the matrix, start within the rank's shard, length)
Piece = Tuple[int, int, int, int]


def assign_owners(costs: Sequence[float], ways: int,
                  loads: Optional[List[float]] = None) -> List[int]:
    """Owner rank of each matrix: largest cost first to the least loaded rank (lowest rank on
    ties), so ranks get about equal work; `loads` carries the load across groups."""
    loads = loads if loads is not None else [0.0] * ways
    owners = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ways), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += costs[i]
    return owners


def shard_matrix_pieces(buckets: Sequence[Bucket], numels: Sequence[int],
                        units: Sequence[MatrixUnit], rank: int) -> List[Piece]:
    """The pieces of `rank`'s shard that belong to matrices, in shard order."""
    by_param: Dict[int, List[Tuple[int, MatrixUnit]]] = {}
    for i, u in enumerate(units):
        by_param.setdefault(u.param, []).append((i, u))
    pieces: List[Piece] = []
    for b in buckets:
        for idx, start, at, length in shard_overlaps(b, numels, rank):
            for i, u in by_param.get(idx, ()):
                lo, hi = max(start, u.offset), min(start + length, u.offset + u.numel)
                if lo < hi:
                    pieces.append((i, lo - u.offset, b.shard_offset + at + lo - start, hi - lo))
    return pieces


@dataclass
class ExchangePlan:
    """What this rank sends to (and gets back from) each owner, and receives from (and
    returns to) each rank: pieces in (matrix, start) order on both sides."""

    rank: int
    owners: List[int]
    send: List[List[Piece]]  # per owner: pieces of this rank's shard
    receive: List[List[Piece]]  # per rank: pieces of its shard whose matrix this rank owns

    @property
    def owned(self) -> List[int]:
        return [i for i, o in enumerate(self.owners) if o == self.rank]


def exchange_plan(buckets: Sequence[Bucket], numels: Sequence[int],
                  units: Sequence[MatrixUnit], owners: Sequence[int], ways: int,
                  rank: int) -> ExchangePlan:
    """`rank`'s side of the exchange over `ways` shards."""
    per_rank = [sorted(shard_matrix_pieces(buckets, numels, units, r)) for r in range(ways)]
    send = [[p for p in per_rank[rank] if owners[p[0]] == o] for o in range(ways)]
    receive = [[p for p in per_rank[r] if owners[p[0]] == rank] for r in range(ways)]
    return ExchangePlan(rank, list(owners), send, receive)


class ShardedMatrices:
    """The matrices of one flat group's shard on this rank, and how their updates are
    computed: `update(u_shard)` -> the update laid out like the shard (zero elsewhere)."""

    def __init__(self, units: List[MatrixUnit], plan: ExchangePlan, group: Group,
                 ways: int) -> None:
        self.units, self.plan, self.group, self.ways = units, plan, group, ways

    def update(self, u: torch.Tensor,
               orthogonalize: Callable[[MatrixUnit, torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
        plan = self.plan
        sent = [_take(u, pieces) for pieces in plan.send]
        received = self._all_to_all(sent, [_length(p) for p in plan.receive])
        whole: Dict[int, torch.Tensor] = {}
        for i in plan.owned:
            unit = self.units[i]
            whole[i] = u.new_empty(unit.numel)
        for r, pieces in enumerate(plan.receive):
            at = 0
            for i, start, _, length in pieces:
                whole[i][start:start + length].copy_(received[r][at:at + length])
                at += length
        updates = {i: orthogonalize(self.units[i], m.view(self.units[i].rows,
                                                          self.units[i].cols)).reshape(-1)
                   for i, m in whole.items()}
        back = [torch.cat([updates[i][s:s + n] for i, s, _, n in pieces]) if pieces else
                u.new_empty(0) for pieces in plan.receive]
        returned = self._all_to_all(back, [_length(p) for p in plan.send])
        out = torch.zeros_like(u)
        for o, pieces in enumerate(plan.send):
            at = 0
            for _, _, position, length in pieces:
                out[position:position + length].copy_(returned[o][at:at + length])
                at += length
        return out

    def _all_to_all(self, chunks: List[torch.Tensor], sizes: List[int]) -> List[torch.Tensor]:
        if self.ways == 1:
            return chunks
        send = torch.cat(chunks) if chunks else torch.empty(0)
        received = send.new_empty(sum(sizes))
        comm.all_to_all(received, send, sizes, [c.numel() for c in chunks], group=self.group)
        return list(received.split(sizes))


def _take(u: torch.Tensor, pieces: List[Piece]) -> torch.Tensor:
    if not pieces:
        return u.new_empty(0)
    return torch.cat([u[at:at + n] for _, _, at, n in pieces])


def _length(pieces: List[Piece]) -> int:
    return sum(n for *_, n in pieces)
