"""The CUDA-only calls behind Megatron's --profile (nsys range) and --record-memory-history:
the one place that makes them (`gigatron.training.observe.profiling` decides when)."""
from __future__ import annotations

import pickle
import torch


def nsys_range_start() -> None:
    """cudaProfilerStart: opens the range an `nsys --capture-range=cudaProfilerApi` run
    records, as Megatron's --profile does."""
    torch.cuda.profiler.start()


def nsys_range_stop() -> None:
    """cudaProfilerStop."""
    torch.cuda.profiler.stop()


def record_memory_history() -> None:
    """Record the CUDA caching allocator's alloc/free events with their Python stacks
    (Megatron's --record-memory-history: up to 100k events)."""
    torch.cuda.memory._record_memory_history("all", max_entries=100_000)


def dump_memory_snapshot(path: str) -> None:
    """Write the allocator snapshot (with the recorded history) as Megatron does: a pickle
    that pytorch.org/memory_viz reads."""
    with open(path, "wb") as f:
        pickle.dump(torch.cuda.memory._snapshot(), f)
