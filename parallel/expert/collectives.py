"""Autograd collectives for token dispatch, with row counts every rank already knows.

`all_to_all` sends variable numbers of rows to each rank; its backward is the reverse
all-to-all with the splits swapped. `gather_rows` / `reduce_scatter_rows` concatenate or sum
blocks of different lengths over a group (each the other's backward); the lengths come from
the dispatcher's token counts, so none of these reads anything from the device.
All traffic goes through `gigatron.parallel.comm` (counted, traced).
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group


def _all_to_all(x: torch.Tensor, output_splits: Sequence[int], input_splits: Sequence[int],
                group: Group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), output_splits, input_splits, group)
    return out


def _gather_rows(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Every rank's block (sizes[i] rows from group rank i) concatenated in rank order."""
    n, longest = len(sizes), max(sizes)
    if longest == 0:
        return x.new_empty((0,) + tuple(x.shape[1:]))
    if min(sizes) < longest:  # all_gather takes equal blocks: pad to the longest
        x = torch.cat([x, x.new_zeros((longest - x.shape[0],) + tuple(x.shape[1:]))])
    out = x.new_empty((n * longest,) + tuple(x.shape[1:]))
    comm.all_gather(out, x.contiguous(), group)
    if min(sizes) == longest:
        return out
    return torch.cat([block[:size] for block, size in zip(out.chunk(n), sizes)])


def _reduce_scatter_rows(x: torch.Tensor, sizes: Sequence[int], group: Group) -> torch.Tensor:
    """Sum over the group of x (blocks of sizes[i] rows) and keep this rank's block."""
    n, longest, me = len(sizes), max(sizes), comm.group_rank(group)
    if longest == 0:
        return x.new_empty((0,) + tuple(x.shape[1:]))
    if min(sizes) < longest:
        padded = x.new_zeros((n, longest) + tuple(x.shape[1:]))
        for block, (rows, size) in enumerate(zip(x.split(list(sizes)), sizes)):
            padded[block, :size] = rows
        x = padded.view((n * longest,) + tuple(x.shape[1:]))
    out = x.new_empty((longest,) + tuple(x.shape[1:]))
    comm.reduce_scatter(out, x.contiguous(), group)
    return out[:sizes[me]]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.sizes, ctx.group), None, None


def all_to_all(x: torch.Tensor, output_splits: List[int], input_splits: List[int],
               group: Group) -> torch.Tensor:
    """Rows of x to each rank (input_splits), theirs back (output_splits); reverse in backward."""
    if comm.group_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


def gather_rows(x: torch.Tensor, sizes: List[int], group: Group) -> torch.Tensor:
    """Concatenate blocks of `sizes[i]` rows from each rank; backward sums and scatters."""
    if comm.group_size(group) == 1:
        return x
    return _GatherRows.apply(x, sizes, group)


def reduce_scatter_rows(x: torch.Tensor, sizes: List[int], group: Group) -> torch.Tensor:
    """Sum partial x over the ranks and keep this rank's `sizes[rank]` rows; backward gathers."""
    if comm.group_size(group) == 1:
        return x
    return _ReduceScatterRows.apply(x, sizes, group)
