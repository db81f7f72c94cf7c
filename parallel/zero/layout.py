"""Pure layout math for flat ZeRO buffers: which parameter goes to which bucket, where, and
which contiguous slice of each bucket a data-parallel rank owns.

A *group* is the list of parameters that share one optimizer param group (and one flat
buffer). Its parameters are packed in order into buckets; each bucket is padded to a
multiple of the shard count so that rank r owns elements [r*S, (r+1)*S) of it. A rank's
shard of the group is the concatenation of its slices of every bucket, in bucket order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch


@dataclass
class Bucket:
    """One reduction unit: parameters packed back to back, padded for even sharding."""

    index: int
    param_indices: List[int] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    numel: int = 0
    padded_numel: int = 0
    shard_numel: int = 0
    group_offset: int = 0
    shard_offset: int = 0
    # Run-time state of a FlatGroup / BucketedGradSync, not part of the plan (not compared):
    param_full: torch.Tensor = field(default_factory=lambda: torch.empty(0), repr=False,
                                     compare=False)
    """The bucket's full parameter buffer, placed by FlatGroup (a view of the flat buffer;
    stage 3: its own buffer, whose storage exists only while gathered)."""
    grad_full: Optional[torch.Tensor] = field(default=None, repr=False, compare=False)
    """The bucket's full fp32 gradient (stages 2-3: only until it is reduced)."""
    pending: int = field(default=0, repr=False, compare=False)
    """Parameters whose gradient has not arrived yet in this backward."""
    dirty: bool = field(default=False, repr=False, compare=False)
    """Some gradient was accumulated since the bucket's last reduction."""
    launched_this_step: bool = field(default=False, repr=False, compare=False)
    """The bucket's reduction was launched during this step's backward."""


def plan_buckets(numels: Sequence[int], bucket_size: int, shard_ways: int,
                 unit_ids: Optional[Sequence[int]] = None) -> List[Bucket]:
    """Pack parameters (given by element counts, in order) into buckets of about
    `bucket_size` elements; a new bucket also starts where `unit_ids` changes."""
    if bucket_size < 1 or shard_ways < 1:
        raise ValueError(f"bucket_size and shard_ways must be >= 1, got {bucket_size}, "
                         f"{shard_ways}")
    buckets: List[Bucket] = []
    current: Optional[Bucket] = None
    for i, n in enumerate(numels):
        new_unit = unit_ids is not None and current is not None and \
            unit_ids[current.param_indices[-1]] != unit_ids[i]
        if current is None or current.numel >= bucket_size or new_unit:
            current = Bucket(index=len(buckets))
            buckets.append(current)
        current.param_indices.append(i)
        current.offsets.append(current.numel)
        current.numel += int(n)
    group_offset = shard_offset = 0
    for b in buckets:
        b.padded_numel = -(-b.numel // shard_ways) * shard_ways
        b.shard_numel = b.padded_numel // shard_ways
        b.group_offset, b.shard_offset = group_offset, shard_offset
        group_offset += b.padded_numel
        shard_offset += b.shard_numel
    return buckets


def shard_overlaps(bucket: Bucket, numels: Sequence[int], rank: int
                   ) -> List[Tuple[int, int, int, int]]:
    """Pieces of parameters inside rank's slice of `bucket`:
    (param index, start within the parameter, start within the rank's bucket slice, length)."""
    lo, hi = rank * bucket.shard_numel, (rank + 1) * bucket.shard_numel
    pieces = []
    for idx, off in zip(bucket.param_indices, bucket.offsets):
        start, end = max(lo, off), min(hi, off + int(numels[idx]))
        if start < end:
            pieces.append((idx, start - off, start - lo, end - start))
    return pieces


def group_sizes(buckets: Sequence[Bucket]) -> Tuple[int, int]:
    """(padded elements of the whole group, elements of one rank's shard)."""
    return (sum(b.padded_numel for b in buckets), sum(b.shard_numel for b in buckets))


def shard_pieces(buckets: Sequence[Bucket], numels: Sequence[int], rank: int
                 ) -> List[Tuple[int, int]]:
    """A rank's whole shard of a group, cut where parameters start and end, in order:
    (param index, or -1 for padding, length); the lengths add up to the shard's size.
    Per-parameter quantities over a shard (Lamb's trust-ratio norms) are sums over these."""
    pieces: List[Tuple[int, int]] = []
    for b in buckets:
        at = 0  # position within this rank's slice of the bucket
        for idx, _, start, length in shard_overlaps(b, numels, rank):
            if start > at:
                pieces.append((-1, start - at))
            pieces.append((idx, length))
            at = start + length
        if at < b.shard_numel:
            pieces.append((-1, b.shard_numel - at))
    return pieces
