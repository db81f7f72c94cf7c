"""--cp-comm-type a2a+p2p (Megatron-Core's hierarchical context parallelism): all-to-all
(Ulysses) within an inner group of A cp ranks, ring attention across the P inner groups.

--hierarchical-context-parallel-sizes A P splits each cp group (cp = A x P) as Megatron-Core
does: the inner (a2a) groups are A consecutive cp ranks, the outer (p2p) groups the ranks at
the same place of each inner group (parallel/topology.py: `hierarchical_cp_groups`). Inner
group k holds the 2 x A sequence chunks kA..kA+A-1 and 2cp-A-kA..2cp-1-kA: coarse chunks k
and 2P-1-k of a split into 2P chunks, which is the ring's load-balanced split over P ranks,
with k the rank's place in its outer group. So: an all-to-all within the inner group trades
the sequence split for a split of the heads (heads divisible by A), the gathered pieces are
put into the coarse order (early chunks in rank order, then late chunks in reverse), the
ring (ring.py) attends them over the outer group, and the inverse steps return the local
queries' output. Inner traffic is the all-to-all's, outer traffic the ring's over P ranks.

Under the per-document split (split.py: every packed document's length a multiple of 2 x cp)
the same holds document by document: inner group k holds chunks kA..kA+A-1 and
2cp-A-kA..2cp-1-kA of every document, i.e. chunks k and 2P-1-k of each document cut in 2P,
which is the per-document split over the P ranks of the outer ring
(`document_coarse_order_index`); the ring then plans each document's chunks (band_cp.py).

The model carries only the cp group and the comm type down to the attention, so the
sub-groups are looked up by the cp group they split (`register_subgroups`, called by the
ProcessGroups that create them).
"""
from __future__ import annotations

from typing import Dict, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context.ring import RingAttention
from gigatron.parallel.context.split import document_rank_positions
from gigatron.parallel.context.ulysses import heads_to_sequence, kv_to_heads, sequence_to_heads

_SUBGROUPS: Dict[object, Tuple[Group, Group]] = {}
FLAG = "--hierarchical-context-parallel-sizes"


def register_subgroups(cp_group: Group, inner: Group, outer: Group) -> None:
    """Record the (a2a, p2p) sub-groups of `cp_group` for --cp-comm-type a2a+p2p."""
    _SUBGROUPS[cp_group] = (inner, outer)


def subgroups_of(cp_group: Group) -> Tuple[Group, Group]:
    """The (a2a, p2p) sub-groups registered for `cp_group`."""
    if cp_group not in _SUBGROUPS:
        raise ValueError(f"--cp-comm-type a2a+p2p needs {FLAG} A P (A x P = "
                         f"--context-parallel-size) so that the sub-groups are created")
    return _SUBGROUPS[cp_group]


def coarse_order_index(local_length: int, inner: int) -> torch.Tensor:
    """Index putting the inner group's gathered pieces (rank order, each rank's early chunk
    then its late one) into the outer ring's load-balanced order (coarse early chunk, then
    coarse late chunk)."""
    chunk = local_length // 2
    early = [torch.arange(i * local_length, i * local_length + chunk) for i in range(inner)]
    late = [torch.arange(i * local_length + chunk, (i + 1) * local_length)
            for i in reversed(range(inner))]
    return torch.cat(early + late)


def document_coarse_order_index(cu_seqlens: Sequence[int], inner: int, outer: int,
                                outer_rank: int) -> torch.Tensor:
    """Under the per-document split, the index putting the inner group's gathered pieces
    (rank order) into the outer ring's per-document split over `outer` ranks, for the inner
    group at place `outer_rank` of its outer group."""
    cp = inner * outer
    gathered = torch.cat([document_rank_positions(cu_seqlens, cp, outer_rank * inner + i)
                          for i in range(inner)])
    wanted = (document_rank_positions(cu_seqlens, outer, outer_rank) if outer > 1
              else torch.arange(int(cu_seqlens[-1])))  # one ring rank: the whole sequence
    where = torch.full((int(cu_seqlens[-1]),), -1, dtype=torch.long)
    where[gathered] = torch.arange(len(gathered))
    return where[wanted]


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inner: Group,
                           outer: Group, causal: bool, scale: float) -> torch.Tensor:
    """Local queries [b, h, s/cp, d] over the whole sequence: heads split over the `inner`
    (a2a) group, the sequence's coarse chunks ringed over the `outer` (p2p) group."""
    order = coarse_order_index(q.shape[2], comm.group_size(inner)).to(q.device)
    q_heads = sequence_to_heads(q, inner).index_select(2, order)
    k_heads, v_heads = kv_to_heads(k, v, inner, order)
    out = RingAttention.apply(q_heads, k_heads, v_heads, outer, causal, scale)
    return heads_to_sequence(out.index_select(2, torch.argsort(order)), inner)
