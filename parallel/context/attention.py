"""The context-parallel attention call: local queries against the cp group's keys/values.

Every comm type takes and returns the load-balanced local pieces ([b, heads, s/cp, d], rank
i holding chunks i and 2cp-1-i of the 2 x cp chunks, see split.py) and equals the unsplit
attention restricted to the local queries, forward and backward.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context.all_gather import all_gather_attention
from gigatron.parallel.context.band_cp import band_context_attention
from gigatron.parallel.context.hierarchical import hierarchical_attention, subgroups_of
from gigatron.parallel.context.ring import RingAttention
from gigatron.parallel.context.split import check_context_parallel
from gigatron.parallel.context.ulysses import ulysses_attention


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               group: Group, comm_type: str = "p2p", causal: bool = True,
                               scale: Optional[float] = None, dropout_p: float = 0.0,
                               window: Optional[int] = None,
                               sink: Optional[torch.Tensor] = None,
                               documents: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Attention of the local queries q [b, heads, s/cp, d] over the keys/values k, v
    [b, kv_heads, s/cp, d] of every rank of the cp `group`; returns the local output.
    a2a+p2p: the sub-groups registered for `group` (hierarchical.py). `window`, `sink`: a
    sliding window and sink logits [heads]; `documents`: the whole sequence's document
    boundaries (global positions, data/documents.py), shared by the b sequences (band_cp.py
    for all three; causal only)."""
    if dropout_p:
        raise ValueError(f"--attention-dropout {dropout_p}: attention dropout under context "
                         f"parallelism is not supported; set --attention-dropout 0")
    if q.dim() != 4 or k.shape != v.shape or (k.shape[0], k.shape[2], k.shape[3]) != (
            q.shape[0], q.shape[2], q.shape[3]):
        raise ValueError(f"context-parallel attention takes q [b, heads, s, d] and k, v "
                         f"[b, kv_heads, s, d]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    cp = comm.group_size(group)
    inner = outer = None
    if comm_type == "a2a+p2p":
        inner, outer = subgroups_of(group)
    sizes = None if inner is None else (comm.group_size(inner), comm.group_size(outer))
    check_context_parallel(q.shape[2] * cp, cp, q.shape[1], k.shape[1], comm_type, sizes)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if window is not None or sink is not None or documents is not None:
        if not causal:
            raise ValueError("a sliding window, sinks or documents need causal attention")
        subgroups = (inner, outer) if inner is not None and outer is not None else None
        return band_context_attention(q, k, v, group, comm_type, window, sink, scale,
                                      subgroups, documents)
    if comm_type == "a2a+p2p":
        return hierarchical_attention(q, k, v, inner, outer, causal, scale)
    if comm_type == "p2p":
        return RingAttention.apply(q, k, v, group, causal, scale)
    if comm_type == "all_gather":
        return all_gather_attention(q, k, v, group, causal, scale)
    return ulysses_attention(q, k, v, group, causal, scale)
