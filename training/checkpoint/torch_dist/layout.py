"""Where this rank's elements of a parameter sit in the global (single-device) tensor: pure
box arithmetic for the torch_dist checkpoint (training/checkpoint/torch_dist/save_load.py).

A *box* is a rectangular block of a tensor: an offset and a size per dimension, what
torch.distributed.checkpoint stores as one chunk. Two facts turn any of gigatron's shards
into boxes of the global tensor:

- A ZeRO shard holds a contiguous range of a parameter's flattened (row-major) elements;
  `flat_range_boxes` cuts such a range into at most 2 x ndim - 1 contiguous boxes.
- A tensor-parallel slice holds, along its partition dimension, one 1/tp slice of each
  stacked block (one block, or SwiGLU's [gate; up], or unequal q, k, v blocks); the padded
  vocabulary adds rows that do not exist globally. An expert-parallel weight is split the
  same way on two dimensions: its experts over ep (dim 0), each expert's ffn over etp
  (SwiGLU's gate and up halves each sliced). `TensorPlacement.pieces` maps a box of the
  local tensor to the boxes of the global tensor it covers (padding dropped).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Box:
    """A rectangular block of a tensor: `offsets` and `sizes` per dimension."""

    offsets: Shape
    sizes: Shape

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: Sequence[int], start: int, length: int) -> List[Tuple[int, Box]]:
    """The row-major elements [start, start + length) of a tensor of `shape` as boxes, each
    contiguous in memory; returns (position of the box's first element in the range, box)
    in order."""
    shape = tuple(int(n) for n in shape)
    total = math.prod(shape)
    if start < 0 or length < 0 or start + length > total:
        raise ValueError(f"flat range [{start}, {start + length}) is outside a tensor of "
                         f"{total} elements {shape}")
    if length == 0:
        return []
    if not shape:
        return [(0, Box((), ()))]
    out: List[Tuple[int, Box]] = []
    _cut(shape, (), start, start + length, start, out)
    return out


def _cut(shape: Shape, prefix: Shape, lo: int, hi: int, base: int,
         out: List[Tuple[int, Box]]) -> None:
    """Append the boxes of the elements [lo, hi) of the sub-tensor at index `prefix` (flat
    offsets within it); `base` is the flat index the returned positions count from."""
    dim = len(prefix)
    rest = shape[dim + 1:]
    inner = math.prod(rest)
    if lo // inner == (hi - 1) // inner and hi - lo < inner:  # inside one row: go deeper
        row = lo // inner
        _cut(shape, prefix + (row,), lo - row * inner, hi - row * inner, base, out)
        return
    whole_from, whole_to = -(-lo // inner), hi // inner  # the rows the range covers whole
    if lo < whole_from * inner:  # the tail of the row before them
        row = whole_from - 1
        _cut(shape, prefix + (row,), lo - row * inner, inner, base, out)
    if whole_to > whole_from:
        box = Box(prefix + (whole_from,) + (0,) * len(rest),
                  (1,) * dim + (whole_to - whole_from,) + rest)
        out.append((_flat_index(shape, prefix) + whole_from * inner - base, box))
    if hi > whole_to * inner:  # the head of the row after them
        _cut(shape, prefix + (whole_to,), 0, hi - whole_to * inner, base, out)


def _flat_index(shape: Shape, prefix: Shape) -> int:
    """Row-major flat index of the first element of the sub-tensor at index `prefix`."""
    index = 0
    for dim, i in enumerate(prefix):
        index += i * math.prod(shape[dim + 1:])
    return index


@dataclass(frozen=True)
class DimSplit:
    """One partitioned dimension: each stacked block along `dim` (`blocks`: their full sizes,
    padding included, in order) is cut into `size` equal slices, and this rank holds slice
    `rank` of every block, concatenated."""

    dim: int
    blocks: Shape
    rank: int
    size: int


@dataclass(frozen=True)
class TensorPlacement:
    """How one rank's local tensor sits in the global tensor.

    Without splits the local tensor is the global one. `partition_dim` is the tensor-parallel
    split: along it the local tensor holds this tp rank's 1/tp_size slice of each block in
    `blocks`. `expert_splits` are expert parallelism's (experts over ep along dim 0, each
    expert's ffn over etp), each on its own dimension. Global coordinates past `global_shape`
    along a split dimension are padding and are not part of the global tensor.
    """

    global_shape: Shape
    local_shape: Shape
    partition_dim: Optional[int] = None
    blocks: Shape = ()
    tp_rank: int = 0
    tp_size: int = 1
    expert_splits: Tuple[DimSplit, ...] = ()

    @property
    def splits(self) -> Tuple[DimSplit, ...]:
        """Every split dimension, the tensor-parallel one first."""
        tp = () if self.partition_dim is None else \
            (DimSplit(self.partition_dim, self.blocks, self.tp_rank, self.tp_size),)
        return tp + self.expert_splits

    def __post_init__(self) -> None:
        split_dims = [s.dim for s in self.splits]
        if len(set(split_dims)) != len(split_dims):
            raise ValueError(f"dimensions {split_dims} are each split at most once")
        for d, (g, n) in enumerate(zip(self.global_shape, self.local_shape)):
            if d not in split_dims and g != n:
                raise ValueError(f"an unpartitioned dimension {d}'s local size {n} differs "
                                 f"from its global size {g}")
        for s in self.splits:
            if any(b % s.size for b in s.blocks) or sum(s.blocks) // s.size != \
                    self.local_shape[s.dim]:
                raise ValueError(f"blocks {s.blocks} split over {s.size} ranks do not make "
                                 f"the local size {self.local_shape[s.dim]} of dimension "
                                 f"{s.dim}")

    def pieces(self, box: Box) -> List[Tuple[Box, Shape]]:
        """The parts of a local `box` that exist globally: (sub-box in local coordinates,
        its offsets in the global tensor)."""
        per_dim = [[(o, n, o)] for o, n in zip(box.offsets, box.sizes)]
        for s in self.splits:
            per_dim[s.dim] = _split_intervals(s, box.offsets[s.dim], box.sizes[s.dim],
                                              self.global_shape[s.dim])
        out = []
        for parts in itertools.product(*per_dim):
            sub = Box(tuple(p[0] for p in parts), tuple(p[1] for p in parts))
            out.append((sub, tuple(p[2] for p in parts)))
        return out


def _split_intervals(split: DimSplit, lo: int, length: int, global_size: int
                     ) -> List[Tuple[int, int, int]]:
    """The local interval [lo, lo + length) of a split dimension as (local start, length,
    global start) runs, each within one block's slice; padding past `global_size` dropped."""
    hi, out = lo + length, []
    local_start = global_start = 0
    for full in split.blocks:
        size = full // split.size
        a, b = max(lo, local_start), min(hi, local_start + size)
        if a < b:
            g = global_start + split.rank * size + (a - local_start)
            b = min(b, a + global_size - g)  # padding rows do not exist
            if b > a:
                out.append((a, b - a, g))
        local_start += size
        global_start += full
    return out
