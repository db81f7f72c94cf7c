"""--split: the train/valid/test shares of a dataset's documents, as Megatron-Core computes them.

Megatron-Core (`parse_and_normalize_split`, `convert_split_vector_to_split_matrix` and the
split indices of `BlendedMegatronDatasetBuilder`) normalises the weights to fractions, lays
them end to end as book-ends [0, f0, f0 + f1, f0 + f1 + f2], and gives split i the documents
[round(start * n), round(end * n)) with Python's round (half to even); a zero weight gives no
split at all. Older Megatron ("legacy" rounding of each share, then a shift so the last
bound is n) puts about a quarter of the boundaries elsewhere; gigatron follows Megatron-Core.
"""
from __future__ import annotations

import itertools
import math
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")
_SEPARATORS = re.compile(r"[,/\s]+")


def parse_split(split: str) -> List[float]:
    """'969,30,1' -> [969.0, 30.0, 1.0]; also '98/2/0', '969, 30, 1' and the quoted forms a
    shell script passes on ('"969,30,1"', "'99,1,0'"), as Megatron reads them."""
    text = str(split).strip().strip("'\"").strip()
    parts = [p for p in _SEPARATORS.split(text) if p]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(not math.isfinite(w) or w < 0 for w in weights) \
            or sum(weights) <= 0:
        raise ValueError(f"--split {split}: give up to three non-negative weights "
                         f"(train,valid,test) with a positive sum, like 969,30,1")
    return weights


def split_bookends(weights: Sequence[float]) -> List[Optional[Tuple[float, float]]]:
    """Megatron-Core's split matrix: per split its (start, end) fraction, None for a zero
    weight."""
    padded = [float(w) for w in weights] + [0.0] * (len(SPLIT_NAMES) - len(weights))
    fractions = (np.array(padded, dtype=np.float64) / np.sum(padded)).tolist()
    ends = list(itertools.accumulate(fractions, initial=0))
    return [(ends[i], ends[i + 1]) if ends[i + 1] > ends[i] else None
            for i in range(len(SPLIT_NAMES))]


def split_ranges(weights: Sequence[float], count: int) -> List[Tuple[int, int]]:
    """[start, end) of each split's documents among `count` (Megatron-Core's rounding); a
    split with weight 0 gets an empty range."""
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"--split {','.join(str(w) for w in weights)}: give up to three "
                         f"non-negative weights (train,valid,test) with a positive sum")
    ranges: List[Tuple[int, int]] = []
    for bookend in split_bookends(weights):
        if bookend is None:
            start = ranges[-1][1] if ranges else 0
            ranges.append((start, start))
        else:
            ranges.append((int(round(bookend[0] * float(count))),
                           int(round(bookend[1] * float(count)))))
    return ranges
