"""The engine's training data loader: each data-parallel rank reads its own share.

A torch DataLoader over a DistributedSampler (shuffled, as DeepSpeed's), one micro-batch per
item; every new pass over it is a new epoch with a new shuffle (DeepSpeed re-reads the same
order each epoch unless the script calls set_epoch).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from gigatron.parallel.activity import waited_for


class EngineDataLoader:
    """Micro-batches of this rank's share of `dataset`; a new shuffle every pass."""

    def __init__(self, dataset: Dataset, micro_batch_size: int, rank: int, world_size: int,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False,
                 seed: int = 0, num_workers: int = 0, pin_memory: bool = False) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise ValueError(f"training_data must be a map-style dataset (with __len__ and "
                             f"__getitem__), got {type(dataset).__name__}: wrap an iterable "
                             f"in a torch.utils.data.Dataset, or build your own DataLoader")
        self.sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank,
                                          shuffle=True, seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=self.sampler,
                                 collate_fn=collate_fn, drop_last=drop_last,
                                 num_workers=num_workers, pin_memory=pin_memory)
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return waited_for(self.loader)  # a stuck loader is named (parallel/watchdog.py)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])


def pin_memory_default(device: torch.device) -> bool:
    """Pinned host memory only helps copies to a GPU."""
    return device.type == "cuda"
