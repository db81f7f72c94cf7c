"""Horovod's reducescatter, alltoall, grouped allgather and sparse allreduce for
`gigatron.horovod`, negotiated like the other collectives (controller.py).

reducescatter splits dim 0 as Horovod does: with R rows over n ranks, the first R % n ranks
get R // n + 1 rows and the rest R // n (the gather pads each piece to the longest). alltoall
sends `splits[i]` rows to rank i (default: equal pieces); every rank's splits travel in the
negotiation, so each rank knows what it receives without another exchange.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

import torch

from gigatron.engine.horovod import process_sets
from gigatron.engine.horovod.basics import Average
from gigatron.engine.horovod.compression import Compression, Compressor
from gigatron.engine.horovod.controller import Launch, describe
from gigatron.engine.horovod.ops import (TORCH_OPS, allgather, allgather_async, group_handles,
                                         resolve_op, scale_, submit, synchronize, to_wire)
from gigatron.engine.horovod.process_sets import global_process_set
from gigatron.parallel import comm


def scatter_rows(rows: int, n: int) -> List[int]:
    """Rows of dim 0 each rank keeps after a reducescatter (Horovod's split)."""
    return [rows // n + (1 if r < rows % n else 0) for r in range(n)]


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing `tensor` over the set and keeping this rank's rows; the input is
    unchanged. Same shape on every rank."""
    op = resolve_op(op)
    if tensor.dim() == 0:
        raise ValueError("hvd.reducescatter: a 0-d tensor has no first dimension to scatter")

    def start(launch: Launch) -> Callable[[], torch.Tensor]:
        n, me = launch.set_size, launch.set_rank
        pieces = scatter_rows(tensor.shape[0], n)
        longest = max(pieces)
        buf, _ = to_wire(tensor)
        buf = buf.clone()
        with torch.no_grad():
            scale_(buf, prescale_factor)
        padded = buf.new_zeros((n * longest,) + tuple(buf.shape[1:]))
        for r, part in enumerate(torch.split(buf, pieces)):
            padded[r * longest:r * longest + part.shape[0]].copy_(part)
        out = buf.new_empty((longest,) + tuple(buf.shape[1:]))
        work = comm.reduce_scatter(out, padded, launch.group, TORCH_OPS[op], async_op=True)

        def finish() -> torch.Tensor:
            work.wait()
            mine = out[:pieces[me]]
            with torch.no_grad():
                scale_(mine, postscale_factor, n if op == Average else 1)
            return mine.to(tensor.device, tensor.dtype)
        return finish
    return submit("reducescatter", describe(tensor, op=int(op)), start, name, process_set)


class _Reducescatter(torch.autograd.Function):
    """reducescatter's gradient: every rank's output gradient gathered back into place
    (times the set size for Sum, as Horovod)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: int,
                process_set: Any, prescale: float, postscale: float) -> torch.Tensor:
        ctx.op, ctx.process_set = op, process_set
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale,
                                               postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        gathered = allgather(grad.contiguous(), process_set=ctx.process_set)
        if ctx.op != Average:
            gathered = gathered * (process_sets.resolve(ctx.process_set).size() or 1)
        return gathered, None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: type[Compressor] = Compression.none, op: int = Average,
                  process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """`tensor` reduced over the set (Average by default), this rank's rows of dim 0;
    differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = _Reducescatter.apply(compressed, name, resolve_op(op), process_set, prescale_factor,
                               postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: int = Average, process_set: Any = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start a reducescatter of each tensor of a list; synchronize gives the list."""
    return group_handles([reducescatter_async(t, None if name is None else f"{name}.{i}", op,
                                              process_set, prescale_factor, postscale_factor)
                          for i, t in enumerate(tensors)])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: type[Compressor] = Compression.none, op: int = Average,
                          process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> List[torch.Tensor]:
    """reducescatter of each tensor of a list; differentiable."""
    return [reducescatter(t, None if name is None else f"{name}.{i}", compression, op,
                          process_set, prescale_factor, postscale_factor)
            for i, t in enumerate(tensors)]


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: Any = global_process_set) -> int:
    """Start an allgather of each tensor of a list; synchronize gives the list."""
    return group_handles([allgather_async(t, None if name is None else f"{name}.{i}",
                                          process_set) for i, t in enumerate(tensors)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: Any = global_process_set) -> List[torch.Tensor]:
    """allgather of each tensor of a list; differentiable."""
    return [allgather(t, None if name is None else f"{name}.{i}", process_set)
            for i, t in enumerate(tensors)]


def _splits(tensor: torch.Tensor, splits: Any, n: int) -> List[int]:
    if splits is None:
        if tensor.dim() == 0 or tensor.shape[0] % n:
            raise ValueError(f"hvd.alltoall: without splits the first dimension "
                             f"({tuple(tensor.shape)}) must be a multiple of the number of "
                             f"ranks ({n})")
        return [tensor.shape[0] // n] * n
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"hvd.alltoall: splits must be int32 (got {splits.dtype})")
        splits = splits.tolist()
    splits = [int(s) for s in splits]
    if len(splits) != n or any(s < 0 for s in splits):
        raise ValueError(f"hvd.alltoall: splits {splits} must give one count >= 0 per rank "
                         f"({n})")
    if sum(splits) > (tensor.shape[0] if tensor.dim() else 0):
        raise ValueError(f"hvd.alltoall: splits {splits} add up to more than the first "
                         f"dimension of the tensor ({tuple(tensor.shape)})")
    return splits


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: Any = global_process_set) -> int:
    """Start sending splits[i] rows of `tensor` to set rank i; synchronize gives (received
    tensor, received splits as int32)."""
    sends = _splits(tensor, splits, process_sets.resolve(process_set).size() or 1)

    def start(launch: Launch) -> Callable[[], Tuple[torch.Tensor, torch.Tensor]]:
        receives = [launch.metas[r]["splits"][launch.set_rank] for r in range(launch.set_size)]
        buf, _ = to_wire(tensor)
        buf = buf[:sum(sends)]
        out = buf.new_empty((sum(receives),) + tuple(buf.shape[1:]))
        work = comm.all_to_all(out, buf, receives, sends, launch.group, async_op=True)

        def finish() -> Tuple[torch.Tensor, torch.Tensor]:
            if work is not None:
                work.wait()
            return (out.to(tensor.device, tensor.dtype),
                    torch.tensor(receives, dtype=torch.int32))
        return finish
    return submit("alltoall", describe(tensor, splits=sends), start, name, process_set)


class _Alltoall(torch.autograd.Function):
    """alltoall's gradient: the output gradient sent back with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: Optional[str],
                process_set: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        out, received = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> Tuple[Optional[torch.Tensor], ...]:
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received,
                                             process_set=ctx.process_set))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: Any = global_process_set
             ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]:
    """Rows of `tensor` scattered to the set's ranks (splits[i] to rank i, default equal)
    and theirs gathered here; with `splits` given also the received splits. Differentiable."""
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: Any = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse COO tensor by gathering every member's indices and values;
    returns a function that waits and gives the reduced sparse tensor (Horovod's form)."""
    op = resolve_op(op)
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(t.indices().t().contiguous(), f"{name}.indices", process_set)
    values = allgather_async(t.values(), f"{name}.values", process_set)

    def handle() -> torch.Tensor:
        gathered_values = synchronize(values)
        gathered_indices = synchronize(indices)
        if op == Average:
            gathered_values = gathered_values / process_sets.resolve(process_set).size()
        return torch.sparse_coo_tensor(gathered_indices.t(), gathered_values, t.shape)
    return handle
