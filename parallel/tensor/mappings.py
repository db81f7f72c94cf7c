"""Autograd-aware communication for tensor and sequence parallelism.

Each mapping is a pair of collectives: one in forward and its adjoint in backward. The
names follow Megatron's: `copy_to` (identity / all-reduce), `reduce_from` (all-reduce /
identity), `scatter_to` and `gather_from` along the last (hidden) dimension, and the
sequence-parallel versions along dim 0 of sequence-first `[s, b, h]` activations.
All collectives go through `gigatron.parallel.comm` so they are counted and traced.
"""
from __future__ import annotations

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group


def tp_size(group: Group) -> int:
    """Size of a tensor-parallel group; None means no tensor parallelism (not the world)."""
    return 1 if group is None else comm.group_size(group)


def tp_rank(group: Group) -> int:
    """This rank's index in the tensor-parallel group (0 without one)."""
    return 0 if group is None else comm.group_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if tp_size(group) == 1:
        return x
    out = x.contiguous().clone()
    comm.all_reduce(out, group=group)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = tp_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dimension {dim} of size {x.shape[dim]} into {n} "
                         f"tensor-parallel parts: make it a multiple of {n}")
    return x.chunk(n, dim=dim)[tp_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    n = tp_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    # all_gather_into_tensor (gloo) wants the output concatenated along dim 0.
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x, group=group)
    if dim == 0:
        return out
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def _reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    n = tp_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by tensor-parallel "
                         f"size {n}: sequence parallelism needs seq_length % tp == 0")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter(out, x, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group), None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.reduce = tensor_parallel_output_grad
        return _gather(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        # Consumers that are tensor-parallel (column-parallel linear) produce partial grads
        # per rank: sum them while scattering. Replicated consumers only need the split.
        if ctx.reduce:
            return _reduce_scatter_first_dim(grad, ctx.group), None, None
        return _split(grad, 0, ctx.group), None, None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, 0, ctx.group), None


def copy_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Identity forward, all-reduce backward: entry of a column-parallel region."""
    return _CopyToTP.apply(x, group)


def reduce_from_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-reduce forward, identity backward: exit of a row-parallel region."""
    return _ReduceFromTP.apply(x, group)


def scatter_to_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's slice of the last dimension; backward all-gathers it."""
    return _ScatterToTP.apply(x, group)


def gather_from_tensor_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """All-gather along the last dimension; backward keeps this rank's slice."""
    return _GatherFromTP.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group: Group = None,
                                         tensor_parallel_output_grad: bool = True
                                         ) -> torch.Tensor:
    """All-gather the sequence (dim 0); backward reduce-scatters (or splits) the grad."""
    return _GatherFromSP.apply(x, group, tensor_parallel_output_grad)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Keep this rank's 1/tp of the sequence (dim 0) of a replicated tensor; backward
    all-gathers the grad (a replicated computation's exit into sequence parallelism)."""
    return _ScatterToSP.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Sum partial results over tp and keep this rank's 1/tp of the sequence."""
    return _ReduceScatterToSP.apply(x, group)
