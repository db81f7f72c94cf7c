"""Blending datasets by weight, with the proportions held in every window of samples.

Dataset d's k-th sample is placed at time (k + 1/2) / w_d and all samples are taken in time
order (ties to the lower dataset id). Each dataset's samples are evenly spaced, so in any
window of n consecutive samples dataset d appears n * w_d times give or take one: the same
guarantee as a greedy largest-deficit assignment, but vectorised and prefix-stable.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import numpy as np


def parse_data_path(data_path: Sequence[str], flag: str = "--data-path"
                    ) -> Tuple[List[str], Optional[List[float]]]:
    """`[w1, p1, w2, p2, ...]` -> (prefixes, normalised weights); `[p1, ...]` -> (prefixes, None)"""
    items = [str(x) for x in data_path]
    if not items:
        raise ValueError(f"{flag} is empty")

    def is_number(x: str) -> bool:
        try:
            float(x)
            return True
        except ValueError:
            return False

    if not any(is_number(x) for x in items):
        return items, None
    if len(items) % 2 or not all(is_number(w) for w in items[0::2]):
        raise ValueError(f"{flag} {' '.join(items)}: give either prefixes only or "
                         f"'weight prefix' pairs like '0.3 dataA 0.7 dataB'")
    return items[1::2], normalise_weights([float(w) for w in items[0::2]], flag)


def normalise_weights(weights: Sequence[float], flag: str = "--data-path") -> List[float]:
    """Weights scaled to sum to one."""
    w = np.asarray(weights, dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0 or not np.isfinite(w).all():
        raise ValueError(f"{flag}: blend weights {list(weights)} must be non-negative with a "
                         f"positive sum")
    return (w / w.sum()).tolist()


def blend_indices(weights: Sequence[float], size: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for `size` blended samples."""
    w = np.asarray(normalise_weights(weights), dtype=np.float64)
    times, ids, ks = [], [], []
    for d, wd in enumerate(w):
        if wd == 0:
            continue
        k = np.arange(int(np.ceil(size * wd)) + len(w) + 2, dtype=np.int64)  # margin: ties
        times.append((k + 0.5) / wd)
        ids.append(np.full(len(k), d, dtype=np.int16))
        ks.append(k)
    all_times, all_ids, all_ks = np.concatenate(times), np.concatenate(ids), np.concatenate(ks)
    order = np.lexsort((all_ids, all_times))[:size]
    return all_ids[order].astype(np.int16), all_ks[order]


def samples_per_dataset(weights: Sequence[float], size: int) -> List[int]:
    """How many samples each dataset contributes to the first `size` blended samples."""
    dataset_index, _ = blend_indices(weights, size)
    return np.bincount(dataset_index, minlength=len(weights)).tolist()


class BlendedDataset:
    """Samples of several datasets interleaved by `blend_indices`."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights):
            raise ValueError(f"{len(datasets)} datasets but {len(weights)} weights")
        self.datasets, self.weights, self.size = list(datasets), list(weights), size
        self.dataset_index, self.dataset_sample_index = blend_indices(weights, size)
        counts = np.bincount(self.dataset_index, minlength=len(datasets))
        for d, (ds, need) in enumerate(zip(self.datasets, counts)):
            if need and (ds is None or len(ds) < need):
                raise ValueError(f"blended dataset {d} has {0 if ds is None else len(ds)} "
                                 f"samples, the blend needs {need}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} blended samples")
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
