"""--cp-comm-type all_gather: gather every rank's keys/values, attend the local queries.

The keys/values are gathered over cp in rank order (each rank's two chunks), so the causal
mask compares global positions: the local queries' (chunks i and 2cp-1-i) with the gathered
keys'. Their gradients are summed back to the owners by the gather's backward (a
reduce-scatter). Simple and one collective per layer, but every rank holds the whole
sequence's keys/values.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context.split import rank_positions
from gigatron.parallel.expert.collectives import gather_rows


def causal_mask(seq_length: int, cp: int, rank: int) -> torch.Tensor:
    """[local queries, gathered keys] True where `rank`'s query may attend the key."""
    queries = rank_positions(seq_length, cp, rank)
    keys = torch.cat([rank_positions(seq_length, cp, r) for r in range(cp)])
    return keys.unsqueeze(0) <= queries.unsqueeze(1)


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                         causal: bool, scale: float) -> torch.Tensor:
    """Local queries [b, h, s/cp, d] against the gathered keys/values of the cp group."""
    cp, local = comm.group_size(group), q.shape[2]
    kv = torch.stack([k, v]).permute(3, 0, 1, 2, 4).contiguous()  # sequence first
    kv = gather_rows(kv, [local] * cp, group).permute(1, 2, 3, 0, 4)
    mask = None
    if causal:
        mask = causal_mask(local * cp, cp, comm.group_rank(group)).to(q.device)
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=mask, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])
