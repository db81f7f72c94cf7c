"""Horovod's collectives for `gigatron.horovod`: allreduce, allgather, broadcast, their
in-place `_` and `_async` forms, `poll` and `synchronize`, all through gigatron.parallel.comm.

An `_async` call returns an integer handle; `synchronize(handle)` waits and returns the
result (the in-place forms: the input tensor), `poll(handle)` says whether it is done.
Out-of-place forms are autograd functions with Horovod's backward rules. Tensors on any
device are accepted: under NCCL a CPU tensor travels through the GPU, under gloo a GPU
tensor through the CPU. Unlike Horovod, collectives are matched by call order, not by
`name` (accepted, unused): every rank must issue them in the same order.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.engine.horovod.basics import (Average, HorovodInternalError, HorovodReduceOp,
                                            Sum, check_process_set, comm_device,
                                            global_process_set, not_implemented, rank, size)
from gigatron.engine.horovod.compression import Compression, Compressor
from gigatron.parallel import comm

TORCH_OPS = {HorovodReduceOp.AVERAGE: comm.ReduceOp.SUM, HorovodReduceOp.SUM: comm.ReduceOp.SUM,
              HorovodReduceOp.MIN: comm.ReduceOp.MIN, HorovodReduceOp.MAX: comm.ReduceOp.MAX,
              HorovodReduceOp.PRODUCT: comm.ReduceOp.PRODUCT}


@dataclass
class _Pending:
    works: List[Any]  # what poll() asks is_completed() of
    finish: Callable[[], Any]  # waits and returns the result


_handles: Dict[int, _Pending] = {}
_next_handle = itertools.count(1)


def _register(works: List[Any], finish: Callable[[], Any]) -> int:
    handle = next(_next_handle)
    _handles[handle] = _Pending(works, finish)
    return handle


def poll(handle: int) -> bool:
    """Whether the asynchronous operation behind `handle` has completed."""
    if handle not in _handles:
        raise ValueError(f"hvd.poll: unknown handle {handle!r} (already synchronized?)")
    return all(w.is_completed() for w in _handles[handle].works)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle`; returns its output (None for an unknown one)."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    try:
        return pending.finish()
    except RuntimeError as err:
        if isinstance(err, HorovodInternalError):
            raise
        raise HorovodInternalError(str(err)) from err


def resolve_op(op: Optional[int], average: Optional[bool] = None) -> HorovodReduceOp:
    """Horovod's op argument: None means Average; the deprecated `average` maps to it."""
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average; provide only one of them.")
    if average is not None:
        warnings.warn("hvd: average= is deprecated, use op=hvd.Average or op=hvd.Sum",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    if op is None:
        return Average
    if op not in set(HorovodReduceOp):
        raise ValueError(f"hvd: unknown reduction op {op!r}; use hvd.Average, hvd.Sum, "
                         f"hvd.Min, hvd.Max or hvd.Product")
    if op == HorovodReduceOp.ADASUM:
        not_implemented("op=hvd.Adasum", "use op=hvd.Average or op=hvd.Sum")
    return HorovodReduceOp(op)


def _to_comm(tensor: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """(a contiguous tensor on the collectives' device holding `tensor`, whether it is a copy)."""
    device, tensor = comm_device(), tensor.detach()
    if tensor.device == device and tensor.is_contiguous():
        return tensor, False
    return tensor.to(device, memory_format=torch.contiguous_format, copy=True), True


def scale_(tensor: torch.Tensor, factor: float, divisor: int = 1) -> None:
    """tensor *= factor / divisor in place; integer tensors truncate toward zero."""
    if factor == 1.0 and divisor == 1:
        return
    if tensor.dtype.is_floating_point or tensor.is_complex():
        if factor != 1.0:
            tensor.mul_(factor)
        if divisor != 1:
            tensor.div_(divisor)
    else:
        tensor.copy_(torch.div(tensor * factor, divisor, rounding_mode="trunc"))


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Optional[int] = None,
                     prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> int:
    """Start reducing `tensor` in place over every rank; returns a handle."""
    op = resolve_op(op, average)
    check_process_set(process_set)
    n = size()
    buf, staged = _to_comm(tensor)
    with torch.no_grad():
        scale_(buf, prescale_factor)
        work = comm.all_reduce(buf, op=TORCH_OPS[op], async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        with torch.no_grad():
            scale_(buf, postscale_factor, n if op == Average else 1)
            if staged:
                tensor.copy_(buf)
        return tensor
    return _register([work], finish)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = global_process_set
               ) -> torch.Tensor:
    """Reduce `tensor` in place over every rank (Average by default); returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor, process_set))


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Optional[int] = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> int:
    """Start reducing a copy of `tensor` (left unchanged); synchronize gives the result."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor,
                            postscale_factor, process_set)


class _Allreduce(torch.autograd.Function):
    """allreduce with Horovod's gradient: the gradients all-reduced with the same op."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, op: int, prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.args = (op, prescale, postscale)
        return synchronize(allreduce_async(tensor, op=op, prescale_factor=prescale,
                                           postscale_factor=postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, prescale, postscale = ctx.args
        return allreduce(grad, op=op, prescale_factor=prescale,
                         postscale_factor=postscale), None, None, None


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """`tensor` reduced over every rank (Average by default) as a new tensor; differentiable."""
    op = resolve_op(op, average)
    check_process_set(process_set)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    """Start reducing each tensor of a list in place; one handle for all of them."""
    handles = [allreduce_async_(t, average, name, op, prescale_factor, postscale_factor,
                                process_set) for t in tensors]
    works = [w for h in handles for w in _handles[h].works]
    return _register(works, lambda: [synchronize(h) for h in handles])


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Optional[int] = None,
                       prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> List[torch.Tensor]:
    """Reduce each tensor of a list in place; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor, process_set))


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> int:
    """Start reducing copies of a list of tensors; synchronize gives the reduced list."""
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor, process_set)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None,
                      compression: type[Compressor] = Compression.none,
                      op: Optional[int] = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set
                      ) -> List[torch.Tensor]:
    """Each tensor of a list reduced over every rank, as new tensors; differentiable."""
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor,
                      process_set) for t in tensors]


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> int:
    """Start concatenating every rank's `tensor` along dim 0 (first dims may differ)."""
    check_process_set(process_set)
    size()
    buf, _ = _to_comm(tensor)
    gathered = comm.all_gather_uneven(buf, async_op=True)
    return _register([gathered], lambda: gathered.wait().to(tensor.device))


class _Allgather(torch.autograd.Function):
    """allgather with Horovod's gradient: this rank's slice of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() else 0
        return synchronize(allgather_async(tensor))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        reduced = allreduce(grad, op=Average)
        rows = allgather(torch.tensor([ctx.rows], device=grad.device)).tolist()
        return reduced.narrow(0, sum(rows[:rank()]), ctx.rows)


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dim 0, in rank order; differentiable."""
    check_process_set(process_set)
    return _Allgather.apply(tensor)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> int:
    """Start overwriting `tensor` on every rank with root_rank's; returns a handle."""
    check_process_set(process_set)
    if not 0 <= root_rank < size():
        raise ValueError(f"hvd.broadcast: root_rank {root_rank} is not a rank of this job "
                         f"(size {size()})")
    buf, staged = _to_comm(tensor)
    work: Any = comm.broadcast(buf, root_rank, async_op=True)

    def finish() -> torch.Tensor:
        work.wait()
        if staged:
            with torch.no_grad():
                tensor.copy_(buf)
        return tensor
    return _register([work], finish)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` on every rank with root_rank's; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> int:
    """Start broadcasting root_rank's `tensor` into a new tensor (the input is unchanged)."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


class _Broadcast(torch.autograd.Function):
    """broadcast with Horovod's gradient: the averaged gradient on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None]:
        reduced = allreduce(grad, op=Average)
        return (reduced if rank() == ctx.root_rank else reduced * 0), None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """root_rank's `tensor` on every rank, as a new tensor; differentiable."""
    check_process_set(process_set)
    return _Broadcast.apply(tensor, root_rank)


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank gets here."""
    check_process_set(process_set)
    size()
    comm.barrier()
