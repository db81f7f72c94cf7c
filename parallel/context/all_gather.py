"""--cp-comm-type all_gather: gather every rank's keys/values, attend the local queries block
by block.

The keys/values are all-gathered over cp (rank r's piece holds chunks r and 2cp-1-r) and put
into global order. Each of the two local query chunks c attends, under a causal mask, only
the keys it may see: the prefix of chunks 0..c-1 as one full block, and its own chunk c as a
causal block (top-left aligned, as torch's is_causal); the partial outputs are merged by
their log-sum-exps (kernels.py). No score or mask tensor of s/cp x s is ever built, and the
backward keeps only what the ring keeps (the local q, k, v, the output and its log-sum-exp):
it gathers the keys/values again, recomputes each block's share of the gradients with the
kernel's own backward, and reduce-scatters the keys'/values' gradients back to their owners.
Activation memory per rank thus falls as 1/cp, at the price of a second all-gather in the
backward (communication per layer: forward (cp-1) 2X, backward (cp-1) 2X gathered and
(cp-1) 2X reduce-scattered, X the local keys' bytes).
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context import kernels
from gigatron.parallel.context.kernels import BlockContext
from gigatron.parallel.context.split import global_order_index, rank_chunks

# (query rows, key rows, causal?) in local query and global key positions
Block = Tuple[slice, slice, bool]


def query_blocks(seq_length: int, cp: int, rank: int, causal: bool) -> List[List[Block]]:
    """Per local query chunk, the key blocks it attends under the load-balanced split: the
    full prefix of earlier chunks (if any) and the causal diagonal chunk."""
    local = seq_length // cp
    if not causal:
        return [[(slice(0, local), slice(0, seq_length), False)]]
    chunk, out = local // 2, []
    for i, c in enumerate(rank_chunks(cp, rank)):
        rows = slice(i * chunk, (i + 1) * chunk)
        blocks = [(rows, slice(0, c * chunk), False)] if c else []
        out.append(blocks + [(rows, slice(c * chunk, (c + 1) * chunk), True)])
    return out


def _gather_global(kv: torch.Tensor, group: Group,
                   order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The cp group's keys/values [2, b, h, s, d] in global sequence order, from the local
    [2, b, h, s/cp, d] (`order`: the split's rank-order-to-global index; None: the
    whole-sequence split's)."""
    cp, local = comm.group_size(group), kv.shape[3]
    if cp == 1:
        return kv
    rows = kv.permute(3, 0, 1, 2, 4).contiguous()  # sequence first: all_gather's dim 0
    gathered = rows.new_empty((cp * local,) + tuple(rows.shape[1:]))
    comm.all_gather(gathered, rows, group)
    order = global_order_index(cp * local, cp) if order is None else order
    return gathered.index_select(0, order.to(kv.device)).permute(1, 2, 3, 0, 4)


def _reduce_scatter_global(dkv: torch.Tensor, group: Group,
                           order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Sum every rank's gradients of the global keys/values [2, b, h, s, d] and keep this
    rank's load-balanced piece [2, b, h, s/cp, d]."""
    cp, seq = comm.group_size(group), dkv.shape[3]
    if cp == 1:
        return dkv
    order = global_order_index(seq, cp) if order is None else order
    inverse = torch.argsort(order).to(dkv.device)
    rows = dkv.permute(3, 0, 1, 2, 4).index_select(0, inverse).contiguous()
    mine = rows.new_empty((seq // cp,) + tuple(rows.shape[1:]))
    comm.reduce_scatter(mine, rows, group)
    return mine.permute(1, 2, 3, 0, 4)


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[:, :, rows]


def gathered_forward(q: torch.Tensor, kv: torch.Tensor, blocks: List[List[Block]],
                     ctx: BlockContext) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output in fp32, log-sum-exp) of the local queries over the global keys/values."""
    b, h, s, d = q.shape  # laid out [b, s, h, d], as the kernels' outputs: the model's
    out = q.new_empty((b, s, h, d), dtype=torch.float32).transpose(1, 2)  # reshape is a view
    lse = q.new_empty(q.shape[:3], dtype=torch.float32)
    for chunk in blocks:
        part = part_lse = None
        for rows, cols, causal in chunk:
            block_out, block_lse = kernels.block_forward(
                _rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols), causal, ctx)
            if part is None or part_lse is None:
                part, part_lse = block_out.float(), block_lse
            else:
                part, part_lse = kernels.merge_partial(part, part_lse, block_out, block_lse)
        assert part is not None and part_lse is not None
        out[:, :, chunk[0][0]], lse[:, :, chunk[0][0]] = part, part_lse
    return out, lse


def gathered_backward(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                      out: torch.Tensor, lse: torch.Tensor, blocks: List[List[Block]],
                      ctx: BlockContext) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dq, the global keys'/values' gradients [2, b, h, s, d]), block by block."""
    dq = torch.zeros_like(q, dtype=torch.float32)
    dkv = torch.zeros_like(kv, dtype=torch.float32)
    for chunk in blocks:
        for rows, cols, causal in chunk:
            dq_block, dk_block, dv_block = kernels.block_backward(
                _rows(grad_out, rows), _rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols),
                _rows(out, rows), _rows(lse, rows), causal, ctx)
            dq[:, :, rows] += dq_block
            dkv[0][:, :, cols] += dk_block
            dkv[1][:, :, cols] += dv_block
    return dq.to(q.dtype), dkv.to(kv.dtype)


class AllGatherAttention(torch.autograd.Function):
    """Exact attention of the local queries over the cp group's gathered keys/values."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                group: Group, causal: bool, scale: Optional[float]) -> torch.Tensor:
        kv = torch.stack([k, v])
        cp = comm.group_size(group)
        blocks = query_blocks(q.shape[2] * cp, cp, comm.group_rank(group), causal)
        block_ctx = BlockContext(kernels.pick_kernel(q), scale)
        out, lse = gathered_forward(q, _gather_global(kv, group), blocks, block_ctx)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)  # local pieces only: no s-long tensor kept
        ctx.group, ctx.blocks, ctx.block_ctx = group, blocks, block_ctx
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = gathered_backward(grad_out.contiguous(), q, _gather_global(kv, ctx.group),
                                    out, lse, ctx.blocks, ctx.block_ctx)
        dkv = _reduce_scatter_global(dkv, ctx.group)
        return dq, dkv[0], dkv[1], None, None, None


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                         causal: bool, scale: float) -> torch.Tensor:
    """Local queries [b, h, s/cp, d] against the gathered keys/values of the cp group."""
    return AllGatherAttention.apply(q, k, v, group, causal, scale)
