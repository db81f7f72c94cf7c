"""The pipeline schedules a plan reads, built once per (rank, pp, m, v, schedule).

`--search` plans thousands of layouts that share a few pipeline shapes; building a
zero-bubble schedule is a list-scheduling pass over every micro-batch, so each shape is
built once here and shared (the schedules are read, never changed).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Tuple

from gigatron.parallel.pipeline.schedules import build_schedule
from gigatron.parallel.pipeline.simulate import SimulationResult, placement_of, simulate


@lru_cache(maxsize=1024)
def rank_schedule(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int,
                  schedule: str = "1f1b") -> Tuple:
    """`build_schedule`'s instructions for one rank, as a tuple (cached)."""
    return tuple(build_schedule(pp_rank, pp_size, num_microbatches, virtual_chunks,
                                schedule=schedule))


def simulate_step(pp_size: int, num_microbatches: int, virtual_chunks: int,
                  forward_time: float, backward_time: float,
                  schedule: str = "1f1b") -> SimulationResult:
    """`simulate.simulate_step` on the cached schedules."""
    schedules = [rank_schedule(r, pp_size, num_microbatches, virtual_chunks, schedule)
                 for r in range(pp_size)]
    return simulate(schedules, forward_time, backward_time, placement=placement_of(schedule))
