"""Horovod's collectives for `gigatron.horovod`: allreduce, allgather, broadcast, their
in-place `_` and `_async` forms, `poll`, `synchronize`, `barrier` and `join`, negotiated by
name in their process set (controller.py) and run through gigatron.parallel.comm.

An `_async` call returns an integer handle; `synchronize(handle)` waits and returns the
result (the in-place forms: the input tensor), `poll(handle)` says whether it is done.
Out-of-place forms are autograd functions with Horovod's backward rules. Tensors on any
device are accepted: under NCCL a CPU tensor travels through the GPU, under gloo a GPU
tensor through the CPU. int16 (which gloo lacks) travels as int32.
"""
from __future__ import annotations

import itertools
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.engine.horovod import process_sets
from gigatron.engine.horovod.basics import (Average, HorovodInternalError, HorovodReduceOp,
                                            Sum, comm_device, not_implemented, rank)
from gigatron.engine.horovod.compression import Compression, Compressor
from gigatron.engine.horovod.controller import (Controller, Launch, Meta, Request, describe,
                                                set_zeros_allreduce)
from gigatron.engine.horovod.process_sets import global_process_set
from gigatron.parallel import comm

TORCH_OPS = {HorovodReduceOp.AVERAGE: comm.ReduceOp.SUM, HorovodReduceOp.SUM: comm.ReduceOp.SUM,
              HorovodReduceOp.MIN: comm.ReduceOp.MIN, HorovodReduceOp.MAX: comm.ReduceOp.MAX,
              HorovodReduceOp.PRODUCT: comm.ReduceOp.PRODUCT}


_handles: Dict[int, Tuple[Controller, Request]] = {}
_next_handle = itertools.count(1)
_orphans: List[Any] = []  # joined ranks' zero allreduces, kept alive until done

# gloo has no int16 (nor the unsigned wide types): they travel as a wider integer, exactly
WIRE_DTYPES = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def submit(kind: str, meta: Meta, start: Callable[[Launch], Callable[[], Any]],
           name: Optional[str], process_set: Any) -> int:
    """Queue an operation in its process set's negotiation; returns its handle."""
    controller = process_sets.resolve(process_set).controller()
    request = controller.submit(Request(kind, meta, start), name)
    handle = next(_next_handle)
    _handles[handle] = (controller, request)
    return handle


def poll(handle: int) -> bool:
    """Whether the asynchronous operation behind `handle` has completed (False until a rank
    waits: operations are matched across ranks when one does)."""
    if handle not in _handles:
        raise ValueError(f"hvd.poll: unknown handle {handle!r} (already synchronized?)")
    entry = _handles[handle]
    if isinstance(entry, list):
        return all(poll(h) for h in entry)
    request = entry[1]
    return request.launched and all(w.is_completed() for w in request.works)


def synchronize(handle: int) -> Any:
    """Wait for the operation behind `handle`; returns its output (None for an unknown one).
    A mismatch between ranks or a failed collective raises HorovodInternalError."""
    entry = _handles.pop(handle, None)
    if entry is None:
        return None
    if isinstance(entry, list):
        return [synchronize(h) for h in entry]
    controller, request = entry
    try:
        controller.wait(request)
        if request.error is not None:
            raise request.error
        return request.finish()  # type: ignore[misc]
    except RuntimeError as err:
        if isinstance(err, HorovodInternalError):
            raise
        raise HorovodInternalError(str(err)) from err


def join(device: int = -1) -> int:
    """Horovod's join: this rank has no more data. Until every rank has joined it adds zeros
    to the other ranks' allreduces (they still divide by the full size); other collectives
    fail while a rank has joined. Returns the rank that joined last, on every rank."""
    return process_sets.resolve(None).controller().join()


def _zeros_allreduce(meta: Meta, launch: Launch) -> None:
    dtype = getattr(torch, meta["dtype"])
    zeros = torch.zeros(meta["shape"], dtype=WIRE_DTYPES.get(dtype, dtype), device=comm_device())
    _orphans[:] = [(w, t) for w, t in _orphans if not w.is_completed()]
    work = comm.all_reduce(zeros, group=launch.group, op=TORCH_OPS[meta["op"]], async_op=True)
    _orphans.append((work, zeros))


set_zeros_allreduce(_zeros_allreduce)


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


def to_wire(tensor: torch.Tensor) -> Tuple[torch.Tensor, bool]:
    """(a contiguous tensor on the collectives' device, in a dtype gloo/NCCL move, holding
    `tensor`; whether it is a copy)."""
    device, tensor = comm_device(), tensor.detach()
    dtype = WIRE_DTYPES.get(tensor.dtype, tensor.dtype)
    if tensor.device == device and tensor.is_contiguous() and dtype == tensor.dtype:
        return tensor, False
    return tensor.to(device, dtype, memory_format=torch.contiguous_format, copy=True), True


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
    """Start reducing `tensor` in place over the process set; returns a handle."""
    op = resolve_op(op, average)
    meta = describe(tensor, op=int(op))

    def start(launch: Launch) -> Callable[[], torch.Tensor]:
        buf, staged = to_wire(tensor)
        with torch.no_grad():
            scale_(buf, prescale_factor)
        work = comm.all_reduce(buf, group=launch.group, op=TORCH_OPS[op], async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            with torch.no_grad():
                scale_(buf, postscale_factor, launch.set_size if op == Average else 1)
                if staged:
                    tensor.copy_(buf)
            return tensor
        return finish
    return submit("allreduce", meta, start, name, process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, process_set: Any = global_process_set
               ) -> torch.Tensor:
    """Reduce `tensor` in place over the process set (Average by default); returns it."""
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
    def forward(ctx: Any, tensor: torch.Tensor, op: int, prescale: float, postscale: float,
                name: Optional[str], process_set: Any) -> torch.Tensor:
        ctx.args = (op, prescale, postscale, process_set)
        return synchronize(allreduce_async(tensor, None, name, op, prescale, postscale,
                                           process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        op, prescale, postscale, process_set = ctx.args
        return (allreduce(grad, op=op, prescale_factor=prescale, postscale_factor=postscale,
                          process_set=process_set), None, None, None, None, None)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: type[Compressor] = Compression.none, op: Optional[int] = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = global_process_set) -> torch.Tensor:
    """`tensor` reduced over the process set (Average by default) as a new tensor;
    differentiable."""
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, op, prescale_factor, postscale_factor, name,
                               process_set)
    return compression.decompress(reduced, ctx)


def _names(name: Optional[str], count: int) -> List[Optional[str]]:
    return [None if name is None else f"{name}.{i}" for i in range(count)]


def group_handles(handles: List[int]) -> int:
    """One handle for several: synchronize gives the list of their results."""
    handle = next(_next_handle)
    _handles[handle] = handles  # type: ignore[assignment]
    return handle


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    """Start reducing each tensor of a list in place; one handle for all of them."""
    return group_handles([allreduce_async_(t, average, n, op, prescale_factor,
                                           postscale_factor, process_set)
                          for t, n in zip(tensors, _names(name, len(tensors)))])


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
    """Each tensor of a list reduced over the process set, as new tensors; differentiable."""
    return [allreduce(t, average, n, compression, op, prescale_factor, postscale_factor,
                      process_set) for t, n in zip(tensors, _names(name, len(tensors)))]


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: Any = global_process_set) -> int:
    """Start concatenating every member's `tensor` along dim 0 (first dims may differ)."""
    if tensor.dim() == 0:
        raise ValueError("hvd.allgather: a 0-d tensor has no first dimension to gather; "
                         "reshape it to [1]")

    def start(launch: Launch) -> Callable[[], torch.Tensor]:
        rows = [launch.metas[r]["shape"][0] for r in range(launch.set_size)]
        buf, _ = to_wire(tensor)
        padded = buf.new_zeros((max(rows),) + tuple(buf.shape[1:]))
        padded[:buf.shape[0]].copy_(buf)
        out = buf.new_empty((launch.set_size * max(rows),) + tuple(buf.shape[1:]))
        work = comm.all_gather(out, padded, launch.group, async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            parts = out.view(launch.set_size, max(rows), *buf.shape[1:])
            joined = torch.cat([parts[r, :n] for r, n in enumerate(rows)])
            return joined.to(tensor.device, tensor.dtype)
        return finish
    return submit("allgather", describe(tensor), start, name, process_set)


class _Allgather(torch.autograd.Function):
    """allgather with Horovod's gradient: this rank's slice of the averaged gradient."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str],
                process_set: Any) -> torch.Tensor:
        ctx.rows, ctx.process_set = tensor.shape[0] if tensor.dim() else 0, process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None]:
        ps = process_sets.resolve(ctx.process_set)
        reduced = allreduce(grad, op=Average, process_set=ps)
        rows = allgather(torch.tensor([ctx.rows], device=grad.device), process_set=ps).tolist()
        return reduced.narrow(0, sum(rows[:ps.rank()]), ctx.rows), None, None


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Every member's `tensor` concatenated along dim 0, in rank order; differentiable."""
    return _Allgather.apply(tensor, name, process_set)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> int:
    """Start overwriting `tensor` on every member with root_rank's (a global rank)."""
    members = process_sets.resolve(process_set).global_ranks()
    if root_rank not in members:
        raise ValueError(f"hvd.broadcast: root_rank {root_rank} is not a rank of the process "
                         f"set (ranks {members})")

    def start(launch: Launch) -> Callable[[], torch.Tensor]:
        buf, staged = to_wire(tensor)
        work = comm.broadcast(buf, root_rank, launch.group, async_op=True)

        def finish() -> torch.Tensor:
            if work is not None:
                work.wait()
            if staged:
                with torch.no_grad():
                    tensor.copy_(buf)
            return tensor
        return finish
    return submit("broadcast", describe(tensor, root=root_rank), start, name, process_set)


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
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str],
                process_set: Any) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], None, None, None]:
        reduced = allreduce(grad, op=Average, process_set=ctx.process_set)
        return (reduced if rank() == ctx.root_rank else reduced * 0), None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """root_rank's `tensor` on every member, as a new tensor; differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every member of the process set gets here (operations submitted before it
    on every member are launched on the way)."""
    synchronize(submit("barrier", {}, lambda launch: lambda: None, None, process_set))
