"""Tensor-parallel communication overlapped with the GEMMs beside it, under sequence
parallelism: Megatron's --tp-comm-overlap (Transformer Engine's userbuffers ring exchange)
and torch's async-TP, as point-to-point rings on `comm.send_recv`.

Under sequence parallelism a column-parallel linear all-gathers its input along the sequence
before its GEMM, and a row-parallel linear reduce-scatters its GEMM's output. Here each of
those collectives is split into tp chunks (one per rank's piece of the sequence) pipelined
with the GEMM of the chunk before:

* all-gather + GEMM (column forward, row backward's dgrad): step k multiplies the chunk this
  rank holds while, asynchronously, it passes that chunk to the next rank and takes the
  previous rank's; after tp steps every chunk was multiplied and the input is gathered.
* GEMM + reduce-scatter (row forward, column backward's dgrad): step k multiplies the chunk
  of rows another rank will own while the running sum of the step before travels to the
  next rank; after tp steps this rank holds the sum of its own chunk over all ranks.

The weight gradient (wgrad) runs after, from the gathered input and output-gradient, as
without overlap, or is deferred to the zero-bubble W step (`wgrad.deferring`). Results equal
the plain collectives' up to the order of the tp-way sums (bit-for-bit at tp 2) and of the
chunked GEMM's rows. With the timeline on, each chunk's GEMM is a span ("GEMM chunk
(tp overlap)") and each exchange an async "send/recv" span from issue to wait, so the merged
trace shows the communication under the compute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gigatron.parallel import comm, timeline
from gigatron.parallel.comm import Group
from gigatron.parallel.tensor import wgrad

GEMM_SPAN = "GEMM chunk (tp overlap)"


@dataclass(frozen=True)
class TPCommOverlap:
    """Which tensor-parallel collectives run chunked under the GEMMs (Megatron's
    --tp-comm-overlap-ag and --tp-comm-overlap-rs, both on by default): `ag` the
    all-gathers (column forward, row dgrad), `rs` the reduce-scatters (row forward, column
    dgrad). A half that is off runs as one collective, as without overlap."""

    ag: bool = True
    rs: bool = True


class _Ring:
    """Passes a tensor to the next rank of `group` and takes the previous rank's, async."""

    def __init__(self, group: Group) -> None:
        n, me = comm.group_size(group), comm.group_rank(group)
        ranks = (list(range(n)) if group is None
                 else dist.get_process_group_ranks(group))  # type: ignore[arg-type]
        self.group, self.next, self.previous = group, ranks[(me + 1) % n], ranks[(me - 1) % n]
        self.works: List[Any] = []
        self.incoming: Optional[torch.Tensor] = None

    def start(self, tensor: torch.Tensor) -> None:
        self.incoming = torch.empty_like(tensor)
        self.works = comm.send_recv([(tensor, self.next)], [(self.incoming, self.previous)],
                                    self.group)

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works = []
        assert self.incoming is not None
        return self.incoming


def _gemm(fn: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
    if not timeline.on:
        return fn(*args)
    start = timeline.now()
    out = fn(*args)
    timeline.record(GEMM_SPAN, start)
    return out


def all_gather_apply(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor],
                     group: Group, pipelined: bool = True
                     ) -> Tuple[torch.Tensor, List[torch.Tensor]]:
    """(every rank's x concatenated along dim 0, [fn(rank i's x) for each rank i]): with
    `pipelined`, fn of each chunk runs while the next chunk travels round the ring."""
    n, me = comm.group_size(group), comm.group_rank(group)
    x = x.contiguous()
    if not pipelined:
        full = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                           device=x.device)
        comm.all_gather(full, x, group=group)
        return full, [_gemm(fn, c) for c in full.chunk(n)]
    held: Dict[int, torch.Tensor] = {}
    outs: Dict[int, torch.Tensor] = {}
    ring, current = _Ring(group), x
    for k in range(n):
        c = (me - k) % n  # the chunk held at step k: rank me - k's
        held[c] = current
        if k < n - 1:
            ring.start(current)
        outs[c] = _gemm(fn, current)
        if k < n - 1:
            current = ring.wait()
    return torch.cat([held[c] for c in range(n)]), [outs[c] for c in range(n)]


def reduce_scatter_apply(fn: Callable[[int], torch.Tensor], group: Group,
                         pipelined: bool = True) -> torch.Tensor:
    """This rank's chunk of sum over ranks of [fn(0); ...; fn(tp - 1)] (fn(c): this rank's
    partial of chunk c): with `pipelined`, fn of each chunk runs while the running sum of the
    chunk before travels to the next rank."""
    n, me = comm.group_size(group), comm.group_rank(group)
    if not pipelined:
        parts = torch.cat([_gemm(fn, c) for c in range(n)]).contiguous()
        out = torch.empty((parts.shape[0] // n,) + tuple(parts.shape[1:]), dtype=parts.dtype,
                          device=parts.device)
        comm.reduce_scatter(out, parts, group=group)
        return out
    ring, total = _Ring(group), None
    for k in range(n):
        c = (me - k - 1) % n  # after tp - 1 hops the sum of chunk c lands on rank c
        part = _gemm(fn, c)
        if k > 0:
            part = part + ring.wait()
        if k < n - 1:
            ring.start(part.contiguous())
        total = part
    assert total is not None
    return total


def _rows(t: torch.Tensor, n: int, c: int) -> torch.Tensor:
    rows = t.shape[0] // n
    return t[c * rows:(c + 1) * rows]


def _weight_grad(ctx: Any, x: torch.Tensor, grad: torch.Tensor) -> Optional[torch.Tensor]:
    """grad^T x for the weight, or None when it went to the zero-bubble W queue."""
    if ctx.queue is not None:
        ctx.queue.push(ctx.owner, x, grad)
        return None
    if not ctx.needs_input_grad[1]:
        return None
    g = grad.reshape(-1, grad.shape[-1])
    return g.t().matmul(x.reshape(-1, x.shape[-1])).to(ctx.w_dtype)


class _AllGatherLinear(torch.autograd.Function):
    """Column-parallel y = all_gather(x) W^T + b; backward: dgrad GEMM + reduce-scatter."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: Optional[torch.Tensor], group: Group, overlap: TPCommOverlap,
                owner: Optional[List[Any]], _needs_grad: torch.Tensor) -> torch.Tensor:
        full, outs = all_gather_apply(x, lambda c: F.linear(c, weight, bias), group,
                                      overlap.ag)
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.overlap, ctx.has_bias, ctx.w_dtype = group, overlap, bias is not None, \
            weight.dtype
        ctx.owner, ctx.queue = owner if owner else (None, None)
        return torch.cat(outs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        full, weight = ctx.saved_tensors
        grad = grad.contiguous()
        n = comm.group_size(ctx.group)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = reduce_scatter_apply(lambda c: _rows(grad, n, c).matmul(weight),
                                          ctx.group, ctx.overlap.rs)
        grad_b = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and \
            ctx.needs_input_grad[2] else None
        return grad_x, _weight_grad(ctx, full, grad), grad_b, None, None, None, None


class _LinearReduceScatter(torch.autograd.Function):
    """Row-parallel y = reduce_scatter(x W^T); backward: all-gather + dgrad GEMM."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                group: Group, overlap: TPCommOverlap, owner: Optional[List[Any]],
                _needs_grad: torch.Tensor) -> torch.Tensor:
        n = comm.group_size(group)
        y = reduce_scatter_apply(lambda c: F.linear(_rows(x, n, c), weight), group,
                                 overlap.rs)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap, ctx.w_dtype = group, overlap, weight.dtype
        ctx.owner, ctx.queue = owner if owner else (None, None)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        full, outs = all_gather_apply(grad, lambda g: g.matmul(weight), ctx.group,
                                      ctx.overlap.ag)
        grad_x = torch.cat(outs) if ctx.needs_input_grad[0] else None
        return grad_x, _weight_grad(ctx, x, full), None, None, None, None


# an input that requires grad, so backward reaches the node even when only a deferred
# weight (passed detached) would need it
_NEEDS_GRAD = torch.empty(0, requires_grad=True)


def _weight_and_owner(weight: torch.Tensor) -> Tuple[torch.Tensor, Optional[List[Any]]]:
    """The weight as the autograd node takes it: detached, with [its parameter, the queue]
    kept aside, when its gradient is deferred to the zero-bubble W step (see wgrad.py; the
    parameter outside autograd's inputs, as there)."""
    queue = wgrad.active_queue()
    if queue is not None and torch.is_grad_enabled() and weight.is_leaf \
            and weight.requires_grad:
        return weight.detach(), [weight, queue]
    return weight, None


def _check_sequence(x: torch.Tensor, n: int) -> None:
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel "
                         f"size {n}: sequence parallelism needs seq_length % tp == 0")


def all_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                      group: Group, overlap: TPCommOverlap = TPCommOverlap()) -> torch.Tensor:
    """F.linear(all_gather_along_sequence(x), weight, bias), the gather pipelined with the
    GEMM (column-parallel linear under sequence parallelism): [s/tp, b, in] -> [s, b, out]."""
    weight, owner = _weight_and_owner(weight)
    return _AllGatherLinear.apply(x, weight, bias, group, overlap, owner, _NEEDS_GRAD)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group: Group,
                          overlap: TPCommOverlap = TPCommOverlap()) -> torch.Tensor:
    """reduce_scatter_along_sequence(F.linear(x, weight)), the reduce-scatter pipelined with
    the GEMM (row-parallel linear under sequence parallelism): [s, b, in] -> [s/tp, b, out]."""
    _check_sequence(x, comm.group_size(group))
    weight, owner = _weight_and_owner(weight)
    return _LinearReduceScatter.apply(x, weight, group, overlap, owner, _NEEDS_GRAD)


def check_overlap(layer: Any) -> None:
    """A column- or row-parallel linear can run with its communication overlapped."""
    if getattr(layer, "fp8", None) is not None:
        raise ValueError(f"{type(layer).__name__}: tp_comm_overlap and fp8 are not composed "
                         f"(the FP8 GEMMs quantise whole tensors): turn one of them off")
    if not layer.sequence_parallel:
        raise ValueError(f"{type(layer).__name__}: tp_comm_overlap needs sequence_parallel "
                         f"(Megatron's --tp-comm-overlap needs --sequence-parallel) and tp > 1")


def enable_tp_comm_overlap(linears: Iterable[Any], overlap: TPCommOverlap = TPCommOverlap()
                           ) -> int:
    """Give each sequence-parallel one of `linears` (Column/RowParallelLinear) `overlap`;
    the others (tp 1) have nothing to overlap. Returns how many were given it."""
    count = 0
    for layer in linears:
        if layer.sequence_parallel:
            check_overlap(layer)
            layer.tp_comm_overlap = overlap
            count += 1
    return count
