"""--cp-comm-type a2a (DeepSpeed-Ulysses): trade the sequence split for a head split.

An all-to-all turns each rank's [b, heads, s/cp, d] into [b, heads/cp, s, d] (rank r keeps
heads r x heads/cp onwards, and key/value heads likewise, so GQA needs the query groups
divisible by cp); the gathered sequence is in rank order (chunks i and 2cp-1-i of each rank),
so it is put into global order for an ordinary causal attention and back before the
all-to-all that returns the local queries' outputs. Communication per layer is independent
of cp's ring length; the limit is heads (or query groups) divisible by cp.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context.split import global_order_index
from gigatron.parallel.expert.collectives import all_to_all


def sequence_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, h, s/cp, d] split by sequence -> [b, h/cp, s, d] split by heads (rank order)."""
    cp = comm.group_size(group)
    b, h, local, d = x.shape
    rows = x.view(b, cp, h // cp, local, d).transpose(0, 1).reshape(cp * b, h // cp, local, d)
    rows = all_to_all(rows, [b] * cp, [b] * cp, group)
    return rows.view(cp, b, h // cp, local, d).permute(1, 2, 0, 3, 4).reshape(
        b, h // cp, cp * local, d)


def heads_to_sequence(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse of sequence_to_heads."""
    cp = comm.group_size(group)
    b, heads, length, d = x.shape
    local = length // cp
    rows = x.view(b, heads, cp, local, d).permute(2, 0, 1, 3, 4).reshape(
        cp * b, heads, local, d)
    rows = all_to_all(rows, [b] * cp, [b] * cp, group)
    return rows.view(cp, b, heads, local, d).transpose(0, 1).reshape(b, cp * heads, local, d)


def kv_to_heads(k: torch.Tensor, v: torch.Tensor, group: Group, order: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """k, v [b, kv_heads, s/n, d] split by sequence -> [b, kv_heads/n, s, d] split by heads
    over `group` (n ranks), the sequence put in `order`; one all-to-all for both."""
    n = comm.group_size(group)
    b, kv_heads, local, d = k.shape
    # k's and v's heads of one head group side by side, so one all-to-all moves both
    kv = torch.stack([k.view(b, n, kv_heads // n, local, d),
                      v.view(b, n, kv_heads // n, local, d)], dim=2)
    kv = sequence_to_heads(kv.view(b, 2 * kv_heads, local, d), group).index_select(2, order)
    k_heads, v_heads = kv.view(b, 2, kv_heads // n, n * local, d).unbind(1)
    return k_heads, v_heads


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                      causal: bool, scale: float) -> torch.Tensor:
    """Local queries [b, h, s/cp, d] attended over the whole sequence, heads split over cp."""
    cp = comm.group_size(group)
    order = global_order_index(q.shape[2] * cp, cp).to(q.device)
    inverse = torch.argsort(order)
    q_heads = sequence_to_heads(q, group).index_select(2, order)
    k_heads, v_heads = kv_to_heads(k, v, group, order)
    kv_heads = k.shape[1]
    out = F.scaled_dot_product_attention(q_heads, k_heads, v_heads, is_causal=causal,
                                         scale=scale, enable_gqa=kv_heads != q.shape[1])
    return heads_to_sequence(out.index_select(2, inverse), group)
