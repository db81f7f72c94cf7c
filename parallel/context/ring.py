"""Ring attention (--cp-comm-type p2p): key/value blocks circulate around the cp group.

At step t rank i holds the keys/values of rank (i - t) mod cp; it sends them on to rank i+1
while it attends to them (the exchange is issued before the compute, so it overlaps where
the backend allows), and merges the partial outputs with their log-sum-exps. With the
load-balanced split (rank i holds chunks i and 2cp-1-i) the block of rank i's queries and
rank j's keys is, under a causal mask:
  j == i  causal over the local 2 chunks (both pairs on the diagonal, the early query chunk
          blind to the late key chunk);
  j <  i  every local query against j's early key chunk only (j's late chunk is in the
          future of both local chunks);
  j >  i  only the late local query chunk, against both of j's chunks.
So each step beyond the first costs the same half block on every rank. The backward sends
the keys/values around again, with their gradients travelling beside them back to the owner.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.context import kernels
from gigatron.parallel.context.kernels import BlockContext

ALL = slice(None)


def block_slices(rank: int, source: int, local_length: int, causal: bool
                 ) -> Tuple[slice, slice, bool]:
    """(query rows, key rows, causal?) of the block of `rank`'s queries and `source`'s
    keys/values, in local sequence positions under the load-balanced split."""
    if source == rank:
        return ALL, ALL, causal
    if not causal:
        return ALL, ALL, False
    half = local_length // 2
    if source < rank:
        return ALL, slice(0, half), False
    return slice(half, None), ALL, False


def _neighbours(group: Group) -> Tuple[int, int]:
    """Global ranks of the next and the previous rank around the ring."""
    n, me = comm.group_size(group), comm.group_rank(group)
    ranks = (list(range(n)) if group is None
             else dist.get_process_group_ranks(group))  # type: ignore[arg-type]
    return ranks[(me + 1) % n], ranks[(me - 1) % n]


class _Ring:
    """Hands a tensor to the next rank and takes the previous rank's, asynchronously.

    Under torch.compile (--torch-compile) the hand-over is an all-to-all in which only the
    neighbours' splits are non-empty: dynamo traces that into the layer's graph, where a
    point-to-point send/recv would break it (and runs it synchronously)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.compiling = torch.compiler.is_compiling()
        if not self.compiling:
            self.next, self.previous = _neighbours(group)
        self.works: List = []
        self.incoming: Optional[torch.Tensor] = None

    def start(self, tensor: torch.Tensor) -> None:
        self.incoming = torch.empty_like(tensor)
        if self.compiling:
            n, me = comm.group_size(self.group), comm.group_rank(self.group)
            size = tensor.numel()
            comm.all_to_all(self.incoming.view(-1), tensor.reshape(-1),
                            [size if r == (me - 1) % n else 0 for r in range(n)],
                            [size if r == (me + 1) % n else 0 for r in range(n)], self.group)
            return
        self.works = comm.send_recv([(tensor, self.next)], [(self.incoming, self.previous)],
                                    self.group)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        assert self.incoming is not None
        return self.incoming


def _rows(t: torch.Tensor, rows: slice) -> torch.Tensor:
    return t[:, :, rows]


def ring_forward(q: torch.Tensor, kv: torch.Tensor, group: Group, causal: bool,
                 ctx: BlockContext) -> Tuple[torch.Tensor, torch.Tensor]:
    """(output in fp32, log-sum-exp) of the local queries against every rank's kv [2, ...]."""
    cp, me = comm.group_size(group), comm.group_rank(group)
    ring = _Ring(group) if cp > 1 else None
    out = lse = None
    for step in range(cp):
        if ring is not None and step + 1 < cp:
            ring.start(kv)
        rows, cols, causal_block = block_slices(me, (me - step) % cp, q.shape[2], causal)
        block_out, block_lse = kernels.block_forward(
            _rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols), causal_block, ctx)
        if out is None or lse is None:  # step 0: the local block covers every query
            out, lse = block_out.float(), block_lse
        else:
            out[:, :, rows], lse[:, :, rows] = kernels.merge_partial(
                _rows(out, rows), _rows(lse, rows), block_out, block_lse)
        if ring is not None and step + 1 < cp:
            kv = ring.wait()
    assert out is not None and lse is not None
    return out, lse


def ring_backward(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, group: Group, causal: bool, ctx: BlockContext
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dq, dkv) of the local queries and the local keys/values [2, ...]."""
    cp, me = comm.group_size(group), comm.group_rank(group)
    kv_ring, grad_ring = (_Ring(group), _Ring(group)) if cp > 1 else (None, None)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dkv = torch.zeros_like(kv)
    for step in range(cp):
        if kv_ring is not None and step + 1 < cp:
            kv_ring.start(kv)
        rows, cols, causal_block = block_slices(me, (me - step) % cp, q.shape[2], causal)
        dq_block, dk_block, dv_block = kernels.block_backward(
            _rows(grad_out, rows), _rows(q, rows), _rows(kv[0], cols), _rows(kv[1], cols),
            _rows(out, rows), _rows(lse, rows), causal_block, ctx)
        dq[:, :, rows] += dq_block
        if grad_ring is not None and step > 0:  # the grads of the kv we now hold
            dkv = grad_ring.wait()
        dkv[0][:, :, cols] += dk_block
        dkv[1][:, :, cols] += dv_block
        if grad_ring is not None:  # on to the next holder; after the last step, the owner
            grad_ring.start(dkv)
        if kv_ring is not None and step + 1 < cp:
            kv = kv_ring.wait()
    if grad_ring is not None:
        dkv = grad_ring.wait()
    return dq.to(q.dtype), dkv


class RingAttention(torch.autograd.Function):
    """Exact causal attention of the local queries over the cp group's keys/values."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                group: Group, causal: bool, scale: Optional[float]) -> torch.Tensor:
        kv = torch.stack([k, v])
        block_ctx = BlockContext(kernels.pick_kernel(q), scale)
        out, lse = ring_forward(q, kv, group, causal, block_ctx)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, kv, out, lse)
        ctx.group, ctx.causal, ctx.block_ctx = group, causal, block_ctx
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        q, kv, out, lse = ctx.saved_tensors
        dq, dkv = ring_backward(grad_out.contiguous(), q, kv, out, lse, ctx.group, ctx.causal,
                                ctx.block_ctx)
        return dq, dkv[0], dkv[1], None, None, None
