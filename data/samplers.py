"""Which samples each data-parallel rank reads, resumable from any consumed-sample count.

Samples are consumed in order, `micro_batch_size * data_parallel_size` at a time; rank r takes
the r-th block of `micro_batch_size` of each such group (Megatron's convention). A global batch
is `num_microbatches` consecutive groups, so the set of samples in a global batch does not
depend on the data-parallel size.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, List, Optional

import numpy as np

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader

    from gigatron.data.gpt_dataset import SampleDataset


class PretrainingSampler:
    """Yields this rank's micro-batches of sample indices, starting at `consumed_samples`."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int, drop_last: bool = True) -> None:
        if total_samples <= 0:
            raise ValueError(f"no samples to load (total_samples={total_samples})")
        if micro_batch_size <= 0:
            raise ValueError(f"--micro-batch-size {micro_batch_size} must be positive")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in "
                             f"[0, {data_parallel_size})")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} is beyond the dataset's "
                             f"{total_samples} samples")
        self.total_samples, self.consumed_samples = total_samples, consumed_samples
        self.micro_batch_size, self.drop_last = micro_batch_size, drop_last
        self.rank, self.dp = data_parallel_rank, data_parallel_size

    def __len__(self) -> int:
        group = self.micro_batch_size * self.dp
        remaining = self.total_samples - self.consumed_samples
        return remaining // group if self.drop_last else -(-remaining // group)

    def __iter__(self) -> Iterator[List[int]]:
        group = self.micro_batch_size * self.dp
        start = self.consumed_samples
        while start + group <= self.total_samples:
            lo = start + self.rank * self.micro_batch_size
            yield list(range(lo, lo + self.micro_batch_size))
            start += group
        if not self.drop_last and start < self.total_samples:
            size = -(-(self.total_samples - start) // self.dp)
            lo = start + self.rank * size
            hi = min(lo + size, self.total_samples)
            if lo < hi:
                yield list(range(lo, hi))


def collate_samples(samples: List[dict]) -> dict:
    """Stack sample dicts into a micro-batch of torch tensors."""
    import torch

    return {key: torch.from_numpy(np.stack([s[key] for s in samples]))
            for key in samples[0]}


def build_pretraining_data_loader(dataset: Optional["SampleDataset"], consumed_samples: int,
                                  micro_batch_size: int, data_parallel_rank: int,
                                  data_parallel_size: int, num_workers: int = 0,
                                  drop_last: bool = True, seed: int = 0
                                  ) -> Optional["DataLoader"]:
    """A torch DataLoader yielding this rank's micro-batch dicts {tokens, labels, loss_mask,
    position_ids}, starting after `consumed_samples` samples; None when `dataset` is None.

    The loader draws (its workers' base seed) from its own generator, derived from `seed`
    and `consumed_samples`, never from torch's default generator: that one feeds dropout,
    and a loader made for evaluation or on resume would otherwise shift its stream. Both
    numbers are in every checkpoint, so a resumed loader is the uninterrupted run's loader.
    """
    import torch

    if dataset is None:
        return None
    num_workers = usable_workers(num_workers)
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size, drop_last)
    # DataLoader needs only __len__/__getitem__ (a map-style dataset), not the Dataset base class
    return torch.utils.data.DataLoader(dataset,  # type: ignore[arg-type]
                                       batch_sampler=sampler, num_workers=num_workers,
                                       collate_fn=collate_samples, pin_memory=False,
                                       persistent_workers=num_workers > 0,
                                       generator=loader_generator(seed, consumed_samples))


def usable_workers(num_workers: int) -> int:
    """`num_workers`, or 0 in a daemonic process (a multiprocessing pool's worker, a forked
    test rank), which may not start worker processes: the batches are the same either way
    (the sampler, not the workers, decides them)."""
    import multiprocessing

    return 0 if num_workers > 0 and multiprocessing.current_process().daemon else num_workers


def loader_generator(seed: int, consumed_samples: int) -> "torch.Generator":
    """The data loader's own generator: a pure function of the run's seed and position."""
    import torch

    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + consumed_samples) % 2 ** 63)
    return generator
