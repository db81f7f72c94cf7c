"""Band attention (sliding windows, sinks: band.py) over a context-parallel split, for every
comm type.

Each comm type moves the keys/values as it does for plain causal attention; what changes is
which blocks are computed. The blocks come from the chunks' global positions (band.py's
`plan_blocks`), so a key chunk entirely outside a query chunk's window is skipped, never
masked, and only the blocks straddling the band's edges are masked (block-sized masks).
  p2p         the ring (ring.py's `_Ring`): at each step the held keys' chunks are those of
              the source rank; blocks planned per source.
  all_gather  the keys/values gathered in global order, the local query chunks planned
              against the 2 x cp key chunks; reduce-scatter of their gradients (all_gather.py).
  a2a         heads split over cp (ulysses.py): the whole sequence on one rank, band.py as is,
              with this rank's slice of the sinks.
  a2a+p2p     heads over the inner group, the band ring over the outer (hierarchical.py;
              under the per-document split the ring holds each document's chunks).
Packed documents (boundaries in global positions) only change the plan: pieces of different
documents are never paired (band.py's `plan_blocks`). Where split.py's rule picks the
per-document split (every document's length a multiple of 2 x cp), the local rows are each
document's chunks i and 2cp-1-i: the plan reads them from the boundaries (`by_document`). The sink (one logit per head) merges
after the last block; its gradient on each rank covers
its local queries (and heads), so summing the gradients over cp, as for every replicated
parameter, gives the whole.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context import band, kernels
from gigatron.parallel.context.all_gather import _gather_global, _reduce_scatter_global
from gigatron.parallel.context.band import Block, Chunk, band_attention
from gigatron.parallel.context.kernels import BlockContext
from gigatron.parallel.context.ring import _Ring
from gigatron.parallel.context.split import (document_local_chunks, document_order_index,
                                             document_split_applies, global_order_index,
                                             rank_chunks)
from gigatron.parallel.context.ulysses import heads_to_sequence, kv_to_heads, sequence_to_heads


def local_chunks(local_length: int, cp: int, rank: int,
                 documents: Optional[Sequence[int]] = None) -> List[Chunk]:
    """The chunks rank `rank` holds: (local row, rows, global start); with `documents`,
    those of the per-document split."""
    if documents is not None:
        return document_local_chunks(documents, cp, rank)
    half = local_length // 2
    return [(i * half, half, c * half) for i, c in enumerate(rank_chunks(cp, rank))]


def _ring_plan(q: torch.Tensor, group: Group, window: Optional[int],
               documents: Optional[Sequence[int]] = None,
               by_document: bool = False) -> List[List[Block]]:
    """Per ring step, the blocks of the local queries against the source's keys."""
    cp, me, local = comm.group_size(group), comm.group_rank(group), q.shape[2]
    split = documents if by_document else None
    mine = local_chunks(local, cp, me, split)
    return [band.plan_blocks(mine, local_chunks(local, cp, (me - step) % cp, split), window,
                             q.device, documents) for step in range(cp)]


class BandRingAttention(torch.autograd.Function):
    """--cp-comm-type p2p with a window and/or sinks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sink: Optional[torch.Tensor], group: Group, window: Optional[int],
                scale: Optional[float], documents: Optional[Sequence[int]] = None,
                by_document: bool = False) -> torch.Tensor:
        plan = _ring_plan(q, group, window, documents, by_document)
        block_ctx = BlockContext(kernels.pick_kernel(q), scale)
        kv, cp = torch.stack([k, v]), len(plan)
        ring = _Ring(group) if cp > 1 else None
        out = lse = None
        for step, blocks in enumerate(plan):
            if ring is not None and step + 1 < cp:
                ring.start(kv)
            out, lse = band.band_forward(q, kv[0], kv[1], blocks, block_ctx, out, lse)
            if ring is not None and step + 1 < cp:
                kv = ring.wait()
        assert out is not None and lse is not None
        out, lse = band.merge_sink(out, lse, sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.group, ctx.plan, ctx.block_ctx = group, plan, block_ctx
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse, sink = ctx.saved_tensors
        grad_out, cp = grad_out.contiguous(), len(ctx.plan)
        kv = torch.stack([k, v])
        kv_ring, grad_ring = (_Ring(ctx.group), _Ring(ctx.group)) if cp > 1 else (None, None)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        for step, blocks in enumerate(ctx.plan):
            if kv_ring is not None and step + 1 < cp:
                kv_ring.start(kv)
            if grad_ring is not None and step > 0:  # the grads of the kv we now hold
                dkv = grad_ring.wait()
            band.band_backward(grad_out, q, kv[0], kv[1], out, lse, blocks, ctx.block_ctx,
                               dq, dkv[0], dkv[1])
            if grad_ring is not None:  # on to the next holder; after the last step, the owner
                grad_ring.start(dkv)
            if kv_ring is not None and step + 1 < cp:
                kv = kv_ring.wait()
        if grad_ring is not None:
            dkv = grad_ring.wait()
        dsink = (band.sink_grad(grad_out, out, lse, sink)
                 if sink is not None and ctx.needs_input_grad[3] else None)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsink, None, None,
                None, None, None)


class BandAllGatherAttention(torch.autograd.Function):
    """--cp-comm-type all_gather with a window and/or sinks."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                sink: Optional[torch.Tensor], group: Group, window: Optional[int],
                scale: Optional[float], documents: Optional[Sequence[int]] = None,
                by_document: bool = False) -> torch.Tensor:
        cp, local = comm.group_size(group), q.shape[2]
        half, split = local // 2, documents if by_document else None
        keys = [(c * half, half, c * half) for c in range(2 * cp)]
        order = None
        if split is not None:  # the gathered keys in global order, cut as the documents
            keys = [(a, e - a, a) for a, e in zip(split, split[1:])]
            order = document_order_index(split, cp)
        blocks = band.plan_blocks(local_chunks(local, cp, comm.group_rank(group), split), keys,
                                  window, q.device, documents)
        block_ctx = BlockContext(kernels.pick_kernel(q), scale)
        kv = _gather_global(torch.stack([k, v]), group, order)
        out, lse = band.merge_sink(*band.band_forward(q, kv[0], kv[1], blocks, block_ctx),
                                   sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)  # local pieces only
        ctx.group, ctx.blocks, ctx.block_ctx, ctx.order = group, blocks, block_ctx, order
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        q, k, v, out, lse, sink = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        kv = _gather_global(torch.stack([k, v]), ctx.group, ctx.order)
        dq = torch.zeros_like(q, dtype=torch.float32)
        dkv = torch.zeros_like(kv, dtype=torch.float32)
        band.band_backward(grad_out, q, kv[0], kv[1], out, lse, ctx.blocks, ctx.block_ctx,
                           dq, dkv[0], dkv[1])
        dkv = _reduce_scatter_global(dkv, ctx.group, ctx.order)
        dsink = (band.sink_grad(grad_out, out, lse, sink)
                 if sink is not None and ctx.needs_input_grad[3] else None)
        return (dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), dsink, None, None,
                None, None, None)


def _head_slice(sink: Optional[torch.Tensor], group: Group) -> Optional[torch.Tensor]:
    """This rank's heads' sinks when the heads are split over `group` (all-to-all)."""
    if sink is None:
        return None
    n = sink.shape[0] // comm.group_size(group)
    return sink[comm.group_rank(group) * n:(comm.group_rank(group) + 1) * n]


def band_context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                           comm_type: str, window: Optional[int], sink: Optional[torch.Tensor],
                           scale: float, subgroups: Optional[Tuple[Group, Group]] = None,
                           documents: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Local queries [b, h, s/cp, d] over the cp group's keys/values inside the band, with
    sinks [h] (None: none); `subgroups`: a2a+p2p's (inner, outer); `documents`: the whole
    sequence's boundaries (global positions, shared by the b sequences; None: one)."""
    cp = comm.group_size(group)
    by_document = documents is not None and document_split_applies(documents, cp, comm_type)
    if comm_type == "p2p":
        return BandRingAttention.apply(q, k, v, sink, group, window, scale, documents,
                                       by_document)
    if comm_type == "all_gather":
        return BandAllGatherAttention.apply(q, k, v, sink, group, window, scale, documents,
                                            by_document)
    if comm_type == "a2a":
        order = (document_order_index(documents, cp) if by_document and documents is not None
                 else global_order_index(q.shape[2] * cp, cp)).to(q.device)
        q_heads = sequence_to_heads(q, group).index_select(2, order)
        k_heads, v_heads = kv_to_heads(k, v, group, order)
        out = band_attention(q_heads, k_heads, v_heads, window, _head_slice(sink, group),
                             scale, documents)
        return heads_to_sequence(out.index_select(2, torch.argsort(order)), group)
    from gigatron.parallel.context.hierarchical import (coarse_order_index,
                                                        document_coarse_order_index)

    assert subgroups is not None
    inner, outer = subgroups
    sizes = comm.group_size(inner), comm.group_size(outer)
    # per document: the ring holds each document's chunks k and 2P-1-k (one ring rank: all)
    ring_by_document = by_document and sizes[1] > 1
    order = (document_coarse_order_index(documents, *sizes, comm.group_rank(outer))
             if by_document and documents is not None
             else coarse_order_index(q.shape[2], sizes[0])).to(q.device)
    q_heads = sequence_to_heads(q, inner).index_select(2, order)
    k_heads, v_heads = kv_to_heads(k, v, inner, order)
    out = BandRingAttention.apply(q_heads, k_heads, v_heads, _head_slice(sink, inner), outer,
                                  window, scale, documents, ring_by_document)
    return heads_to_sequence(out.index_select(2, torch.argsort(order)), inner)
