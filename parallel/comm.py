"""The collectives every part of gigatron uses: device-agnostic, counted, optionally traced.

Counting follows the bandwidth-optimal (ring) algorithm, per rank, whatever the backend does
internally: all-reduce sends 2(n-1)/n of the buffer, reduce-scatter (n-1)/n of its input,
all-gather (n-1)/n of its output, broadcast the buffer once, point-to-point and all-to-all
what they send to other ranks.
That is the convention of the ZeRO paper's communication-volume analysis.
Set GIGATRON_TRACE_COMM=1 to print every collective with its shape and group size.
"""
from __future__ import annotations

import math
import os
import sys
from collections import defaultdict
from typing import Any, Dict, List, Literal, Optional, Protocol, Sequence, Union, overload

import torch
import torch.distributed as dist

from gigatron.parallel import timeline
from gigatron.parallel.activity import activity

ReduceOp = dist.ReduceOp


class ShapeOnlyGroup:
    """A group's size and this rank's index in it with no processes behind it: layers read
    their tensor-parallel shapes from it, so a layout's model can be built on the meta device
    without torch.distributed (gigatron plan). Every collective over it raises."""

    def __init__(self, size: int, rank: int = 0) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"ShapeOnlyGroup(size={size}, rank={rank}): need size >= 1 and "
                             f"0 <= rank < size")
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"ShapeOnlyGroup(size={self._size}, rank={self._rank})"


# a process group; None means the default (world) group, as in torch.distributed
Group = Optional[Union[dist.ProcessGroup, ShapeOnlyGroup]]


class Work(Protocol):
    """The handle of an asynchronous collective (torch's Work, or `_Done` for a group of one)."""

    def wait(self) -> Any: ...
# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommStats:
    """Bytes sent and calls made by this process, per collective type."""

    def __init__(self) -> None:
        self.bytes: Dict[str, int] = defaultdict(int)
        self.calls: Dict[str, int] = defaultdict(int)

    def add(self, op: str, nbytes: float) -> None:
        self.bytes[op] += int(round(nbytes))
        self.calls[op] += 1

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> Dict[str, int]:
        return dict(self.bytes)

    def total(self) -> int:
        return sum(self.bytes.values())


stats = CommStats()  # process-wide counter, read by benchmarks and tests
_TRACE = os.environ.get("GIGATRON_TRACE_COMM", "0") == "1"


class _Done:
    """Handle of a collective that needed no communication (group of one)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def group_size(group: Group = None) -> int:
    """Ranks in `group` (1 without torch.distributed)."""
    if isinstance(group, ShapeOnlyGroup):
        return group.size()
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: Group = None) -> int:
    """This process's index in `group` (0 without torch.distributed)."""
    if isinstance(group, ShapeOnlyGroup):
        return group.rank()
    return dist.get_rank(group) if dist.is_initialized() else 0


def _process_group(group: Group, op: str) -> Optional[dist.ProcessGroup]:
    """`group` as torch.distributed takes it; a shape-only group has no processes to run on."""
    if isinstance(group, ShapeOnlyGroup):
        raise RuntimeError(f"{op} over {group!r}: a shape-only group only describes a layout "
                           f"(for planning); build the model with a real process group to "
                           f"run it")
    return group


def _record(op: str, nbytes: float, tensor: torch.Tensor, n: int, group: Group
            ) -> Optional[timeline.Token]:
    """Count the collective; with the timeline on, the token its span starts from."""
    stats.add(op, nbytes)
    activity.entered(op, group, n)
    if _TRACE:
        print(f"[comm rank {group_rank()}] {op} {tuple(tensor.shape)} {tensor.dtype} "
              f"group={n} bytes={int(nbytes)}", file=sys.stderr)
    return timeline.issue(activity.collective or op, nbytes) if timeline.on else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _compiling() -> bool:
    """Inside a torch.compile trace (--torch-compile): collectives go through torch's
    functional collectives, which dynamo puts in the graph; the counting, activity and
    timeline bookkeeping (host-side Python) is skipped there, so a compiled layer's
    collectives are not in `stats`."""
    return torch.compiler.is_compiling()


def _functional():
    import torch.distributed._functional_collectives as funcol

    return funcol


def _traced_group(pg: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """The group a functional collective takes (they have no None for the world)."""
    return dist.group.WORLD if pg is None else pg  # type: ignore[return-value]


_FUNCTIONAL_OPS = {ReduceOp.SUM: "sum", ReduceOp.MAX: "max", ReduceOp.MIN: "min",
                   ReduceOp.AVG: "avg", ReduceOp.PRODUCT: "product"}


Op = dist.ReduceOp.RedOpType


# async_op=True always gives a handle to wait on; a blocking call gives None.
@overload
def all_reduce(tensor: torch.Tensor, group: Group = ..., op: Op = ..., *,
               async_op: Literal[True]) -> Work: ...
@overload
def all_reduce(tensor: torch.Tensor, group: Group = ..., op: Op = ...,
               async_op: bool = ...) -> Optional[Work]: ...


def all_reduce(tensor: torch.Tensor, group: Group = None, op: Op = ReduceOp.SUM,
               async_op: bool = False) -> Optional[Work]:
    """In-place all-reduce of `tensor` over `group`."""
    pg = _process_group(group, "all_reduce")
    n = group_size(pg)
    if n == 1:
        return _Done() if async_op else None
    if _compiling() and not async_op:
        tensor.copy_(_functional().all_reduce(tensor, _FUNCTIONAL_OPS[op], _traced_group(pg)))
        return None
    span = _record("all_reduce", 2 * (n - 1) / n * _nbytes(tensor), tensor, n, group)
    work = dist.all_reduce(tensor, op=op, group=pg, async_op=async_op)
    return work if span is None else timeline.complete(span, work)


@overload
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group = ..., op: Op = ...,
                   *, async_op: Literal[True]) -> Work: ...
@overload
def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group = ..., op: Op = ...,
                   async_op: bool = ...) -> Optional[Work]: ...


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Group = None,
                   op: Op = ReduceOp.SUM, async_op: bool = False) -> Optional[Work]:
    """Reduce `input` over `group` and keep this rank's contiguous 1/n slice in `output`."""
    pg = _process_group(group, "reduce_scatter")
    n = group_size(pg)
    if input.numel() != output.numel() * n:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected "
                         f"output {output.numel()} x group size {n}")
    if n == 1:
        output.copy_(input.view_as(output))
        return _Done() if async_op else None
    if _compiling() and not async_op:
        output.copy_(_functional().reduce_scatter_tensor(
            input.reshape(n * output.shape[0], *output.shape[1:]), _FUNCTIONAL_OPS[op], 0,
            _traced_group(pg)).view_as(output))
        return None
    span = _record("reduce_scatter", (n - 1) / n * _nbytes(input), input, n, group)
    work = _reduce_scatter_tensor(output, input, op=op, group=pg, async_op=async_op)
    return work if span is None else timeline.complete(span, work)


@overload
def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = ..., *,
               async_op: Literal[True]) -> Work: ...
@overload
def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = ...,
               async_op: bool = ...) -> Optional[Work]: ...


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Group = None,
               async_op: bool = False) -> Optional[Work]:
    """Concatenate every rank's `input` (in group-rank order) into `output` along dim 0."""
    pg = _process_group(group, "all_gather")
    n = group_size(pg)
    if output.numel() != input.numel() * n:
        raise ValueError(f"all_gather: output has {output.numel()} elements, expected "
                         f"input {input.numel()} x group size {n}")
    if n == 1:
        output.copy_(input.view_as(output))
        return _Done() if async_op else None
    if _compiling() and not async_op:
        output.copy_(_functional().all_gather_tensor(input.contiguous(), 0, _traced_group(pg))
                     .view_as(output))
        return None
    span = _record("all_gather", (n - 1) / n * _nbytes(output), output, n, group)
    work = _all_gather_tensor(output, input.contiguous(), group=pg, async_op=async_op)
    return work if span is None else timeline.complete(span, work)


class Gathered:
    """Handle of `all_gather_uneven`: `wait()` gives every rank's tensor concatenated."""

    def __init__(self, work: Optional[Work], output: torch.Tensor, sizes: List[int]) -> None:
        self.work, self.output, self.sizes = work, output, sizes

    def wait(self) -> torch.Tensor:
        """Block until gathered; returns the concatenation along dim 0, padding removed."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        if len(self.sizes) == 1:
            return self.output
        rows = self.output.view(len(self.sizes), -1, *self.output.shape[1:])
        return torch.cat([rows[i, :n] for i, n in enumerate(self.sizes)])

    def is_completed(self) -> bool:
        return self.work is None or bool(self.work.is_completed())  # type: ignore[attr-defined]


def all_gather_uneven(input: torch.Tensor, group: Group = None,
                      async_op: bool = False) -> Gathered:
    """Concatenate every rank's `input` along dim 0 when first dims differ between ranks
    (other dims must agree): the sizes are exchanged first, then padded rows gathered."""
    pg = _process_group(group, "all_gather_uneven")
    n = group_size(pg)
    if input.dim() == 0:
        raise ValueError("all_gather_uneven: a 0-d tensor has no first dimension to gather")
    if n == 1:
        return Gathered(None, input.clone(), [input.shape[0]])
    shape = torch.tensor([input.dim(), input.shape[0], math.prod(input.shape[1:])],
                         device=input.device)
    shapes = torch.empty(3 * n, dtype=shape.dtype, device=input.device)
    all_gather(shapes, shape, pg)
    dims, sizes, rows = shapes.view(n, 3).t().tolist()
    if len(set(dims)) > 1 or len(set(rows)) > 1:
        raise ValueError(f"all_gather_uneven: tensors may differ only in their first dimension; "
                         f"this rank has shape {tuple(input.shape)}, the ranks have "
                         f"{dims} dims and {rows} elements per row")
    padded = input.new_zeros((max(sizes),) + tuple(input.shape[1:]))
    padded[:input.shape[0]].copy_(input)
    output = input.new_empty((n * max(sizes),) + tuple(input.shape[1:]))
    return Gathered(all_gather(output, padded, pg, async_op=async_op), output, sizes)


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
               input_splits: Sequence[int], group: Group = None,
               async_op: bool = False) -> Optional[Work]:
    """Send input_splits[i] rows (dim 0) of `input` to group rank i and receive
    output_splits[i] rows from it into `output`, in group-rank order (variable split sizes)."""
    pg = _process_group(group, "all_to_all")
    n = group_size(pg)
    if len(input_splits) != n or len(output_splits) != n:
        raise ValueError(f"all_to_all: {len(input_splits)} input and {len(output_splits)} "
                         f"output splits for a group of {n}: give one per rank")
    if n == 1:
        output.copy_(input)
        return _Done() if async_op else None
    if _compiling() and not async_op:
        output.copy_(_functional().all_to_all_single(input.contiguous(), list(output_splits),
                                                     list(input_splits), _traced_group(pg)))
        return None
    row_bytes = math.prod(input.shape[1:]) * input.element_size()
    sent = (sum(input_splits) - input_splits[group_rank(pg)]) * row_bytes
    span = _record("all_to_all", sent, input, n, group)
    work = dist.all_to_all_single(output, input.contiguous(), list(output_splits),
                                  list(input_splits), group=pg, async_op=async_op)
    return work if span is None else timeline.complete(span, work)


def broadcast(tensor: torch.Tensor, src: int, group: Group = None,
              async_op: bool = False) -> Optional[Work]:
    """Broadcast `tensor` from global rank `src` to `group`."""
    pg = _process_group(group, "broadcast")
    n = group_size(pg)
    if n == 1:
        return _Done() if async_op else None
    if group_rank() == src:
        span = _record("broadcast", _nbytes(tensor), tensor, n, group)
    else:
        activity.entered("broadcast", group, n)
        span = timeline.issue(activity.collective or "broadcast", 0) if timeline.on else None
    work = dist.broadcast(tensor, src=src, group=pg, async_op=async_op)
    return work if span is None else timeline.complete(span, work)


def send_recv(sends: Sequence = (), recvs: Sequence = (), group: Group = None) -> List:
    """Batched point-to-point: `sends`/`recvs` are (tensor, global peer rank) pairs.

    Returns the request handles; wait on them before reading a received tensor.
    """
    pg = _process_group(group, "send_recv")
    ops = [dist.P2POp(dist.isend, t, peer, pg) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, pg) for t, peer in recvs]
    for t, _ in sends:
        _record("send", _nbytes(t), t, 2, group)
    if not ops:
        return []
    peers = sorted({peer for _, peer in list(sends) + list(recvs)})
    activity.entered(f"send/recv with rank{'s' if len(peers) > 1 else ''} "
                     f"{', '.join(map(str, peers))}", group, 2)
    span = timeline.issue(activity.collective or "send/recv", sum(
        _nbytes(t) for t, _ in sends)) if timeline.on else None  # issue to the last wait
    works = dist.batch_isend_irecv(ops)
    return works if span is None else timeline.complete_all(span, works)


def barrier(group: Group = None) -> None:
    """Wait until every rank of `group` reaches this call."""
    pg = _process_group(group, "barrier")
    if group_size(pg) > 1:
        activity.entered("barrier", pg, group_size(pg))
        span = timeline.issue(activity.collective or "barrier", 0) if timeline.on else None
        dist.barrier(group=pg)
        if span is not None:
            timeline.complete(span, None)
