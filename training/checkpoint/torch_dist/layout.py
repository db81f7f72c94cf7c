"""Where this rank's elements of a parameter sit in the global (single-device) tensor: pure
box arithmetic for the torch_dist checkpoint (training/checkpoint/torch_dist/save_load.py).

A *box* is a rectangular block of a tensor: an offset and a size per dimension, what
torch.distributed.checkpoint stores as one chunk. Two facts turn any of gigatron's shards
into boxes of the global tensor:

- A ZeRO shard holds a contiguous range of a parameter's flattened (row-major) elements;
  `flat_range_boxes` cuts such a range into at most 2 x ndim - 1 contiguous boxes.
- A tensor-parallel slice holds, along its partition dimension, one 1/tp slice of each
  stacked block (one block, or SwiGLU's [gate; up], or unequal q, k, v blocks); the padded
  vocabulary adds rows that do not exist globally. `TensorPlacement.pieces` maps a box of
  the local tensor to the boxes of the global tensor it covers (padding dropped).
"""
from __future__ import annotations

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
class TensorPlacement:
    """How one rank's local tensor sits in the global tensor.

    Without `partition_dim` the local tensor is the global one. With it, the local tensor
    holds along `partition_dim` this tp rank's 1/tp_size slice of each block in `blocks`
    (the blocks' full sizes, padding included, stacked in order); global coordinates past
    `global_shape` along that dimension are padding and are not part of the global tensor.
    """

    global_shape: Shape
    local_shape: Shape
    partition_dim: Optional[int] = None
    blocks: Shape = ()
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        d = self.partition_dim
        if d is None:
            if self.global_shape != self.local_shape:
                raise ValueError(f"an unpartitioned tensor's local shape {self.local_shape} "
                                 f"differs from its global shape {self.global_shape}")
            return
        if any(b % self.tp_size for b in self.blocks) or \
                sum(self.blocks) // self.tp_size != self.local_shape[d]:
            raise ValueError(f"blocks {self.blocks} split over {self.tp_size} tensor-parallel "
                             f"ranks do not make the local size {self.local_shape[d]} of "
                             f"dimension {d}")

    def pieces(self, box: Box) -> List[Tuple[Box, Shape]]:
        """The parts of a local `box` that exist globally: (sub-box in local coordinates,
        its offsets in the global tensor)."""
        d = self.partition_dim
        if d is None:
            return [(box, box.offsets)]
        lo, hi = box.offsets[d], box.offsets[d] + box.sizes[d]
        out = []
        local_start = global_start = 0
        for full in self.blocks:
            size = full // self.tp_size
            a, b = max(lo, local_start), min(hi, local_start + size)
            if a < b:
                g = global_start + self.tp_rank * size + (a - local_start)
                b = min(b, a + self.global_shape[d] - g)  # padding rows do not exist
                if b > a:
                    sub = Box(_with(box.offsets, d, a), _with(box.sizes, d, b - a))
                    out.append((sub, _with(box.offsets, d, g)))
            local_start += size
            global_start += full
        return out


def _with(values: Shape, dim: int, value: int) -> Shape:
    return values[:dim] + (value,) + values[dim + 1:]
