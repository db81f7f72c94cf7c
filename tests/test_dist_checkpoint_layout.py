"""The box arithmetic of the torch_dist checkpoint, exhaustively and without processes: a flat
range of any tensor is the union of the boxes it is cut into, in order and each contiguous;
the pieces of every tp rank's slice (stacked blocks, unequal blocks, padded vocabulary)
cover the global tensor exactly once and hold its values; a ZeRO range of a slice goes to
the same global elements as the slice itself."""
import itertools
import math

import pytest
import torch

from gigatron.parallel.tensor.init import shard
from gigatron.training.checkpoint.torch_dist.layout import Box, TensorPlacement, flat_range_boxes
from gigatron.training.checkpoint.torch_dist.planner import ShardedValue
from gigatron.training.checkpoint.torch_dist.state import add_flat, add_whole


def _region(t, box):
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3), (2, 2, 2, 3), ()])
def test_flat_range_is_cut_into_contiguous_boxes_in_order(shape):
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for start in range(n):
        for length in range(n - start + 1):
            boxes = flat_range_boxes(shape, start, length)
            assert len(boxes) <= max(1, 2 * len(shape) - 1)
            seen = []
            for position, box in boxes:
                values = _region(full, box).reshape(-1).tolist()
                assert values == list(range(start + position, start + position + box.numel))
                seen += values
            assert seen == list(range(start, start + length))


def test_a_range_outside_the_tensor_is_refused():
    with pytest.raises(ValueError, match=r"flat range \[4, 7\) is outside a tensor of 6"):
        flat_range_boxes((2, 3), 4, 3)


def _global_from_pieces(placement_of_rank, tp, local_of_rank, global_shape):
    """Scatter every tp rank's pieces into a global tensor; counts how often each element
    was written."""
    out = torch.full(global_shape, float("nan"))
    hits = torch.zeros(global_shape)
    for rank in range(tp):
        value = ShardedValue(global_shape)
        add_whole(value, local_of_rank(rank), placement_of_rank(rank))
        for offsets, t in value.pieces:
            box = Box(offsets, tuple(t.shape))
            _region(out, box).copy_(t)
            _region(hits, box).add_(1)
    return out, hits


@pytest.mark.parametrize("stride,dim,full_shape,valid", [
    (1, 0, (12, 5), None), (1, 1, (5, 12), None), (2, 0, (16, 3), None),
    ((8, 4, 4), 0, (16, 3), None), (1, 0, (16, 4), 13), (1, 0, (16, 4), 16)])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_slices_cover_the_global_tensor_once_with_its_values(stride, dim, full_shape,
                                                                valid, tp):
    full = torch.arange(math.prod(full_shape), dtype=torch.float32).view(full_shape)
    if valid is not None:
        full[valid:] = 0  # padding rows, which do not exist globally
    global_shape = full_shape if valid is None else (valid,) + full_shape[1:]
    blocks = tuple(stride) if isinstance(stride, tuple) else \
        (full_shape[dim] // stride,) * stride

    def local(rank):
        return shard(full, dim, rank, tp, stride)

    def placement(rank):
        return TensorPlacement(global_shape, tuple(local(rank).shape), dim, blocks, rank, tp)

    out, hits = _global_from_pieces(placement, tp, local, global_shape)
    assert torch.equal(hits, torch.ones(global_shape))
    assert torch.equal(out, full[tuple(slice(0, n) for n in global_shape)])


@pytest.mark.parametrize("stride", [1, 2, (8, 4, 4)])
def test_a_zero_range_of_a_tp_slice_lands_where_the_slice_does(stride):
    full_shape, tp = (16, 3), 2
    full = torch.arange(48, dtype=torch.float32).view(full_shape)
    blocks = tuple(stride) if isinstance(stride, tuple) else (16 // stride,) * stride
    for rank in range(tp):
        local = shard(full, 0, rank, tp, stride)
        placement = TensorPlacement(full_shape, tuple(local.shape), 0, blocks, rank, tp)
        whole = ShardedValue(full_shape)
        add_whole(whole, local, placement)
        expected = torch.full(full_shape, float("nan"))
        for offsets, t in whole.pieces:
            _region(expected, Box(offsets, tuple(t.shape))).copy_(t)
        n = local.numel()
        for start, length in itertools.product(range(0, n, 5), (1, 7, 13)):
            length = min(length, n - start)
            value = ShardedValue(full_shape)
            add_flat(value, local.reshape(-1)[start:start + length], start, placement)
            assert sum(t.numel() for _, t in value.pieces) == length
            for offsets, t in value.pieces:
                assert torch.equal(t, _region(expected, Box(offsets, tuple(t.shape))))


def test_placement_refuses_blocks_that_do_not_make_the_local_size():
    with pytest.raises(ValueError, match="do not make the local size"):
        TensorPlacement((16, 3), (6, 3), 0, (16,), 0, 2)
