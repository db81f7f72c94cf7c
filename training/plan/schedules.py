"""The pipeline schedules a plan reads, built once per (rank, pp, m, v, schedule).

`--search` plans thousands of layouts that share a few pipeline shapes; building a
zero-bubble schedule is a list-scheduling pass over every micro-batch, so each shape is
built once here and shared (the schedules are read, never changed), and so are what each
rank holds after each of its passes (`peak_held`: only the distinct states are kept) and
the simulator's program of the step (`step_makespan`: each layout's times replayed on it).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Callable, Dict, List, Sequence, Tuple

from gigatron.parallel.pipeline.schedules import build_schedule
from gigatron.parallel.pipeline.simulate import (StepProgram, compile_step,
                                                 held_after_each_pass, peak_of_states,
                                                 placement_of, run_step)


@lru_cache(maxsize=1024)
def rank_schedule(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int,
                  schedule: str = "1f1b") -> Tuple:
    """`build_schedule`'s instructions for one rank, as a tuple (cached)."""
    return tuple(build_schedule(pp_rank, pp_size, num_microbatches, virtual_chunks,
                                schedule=schedule))


@lru_cache(maxsize=32)
def _program(pp_size: int, num_microbatches: int, virtual_chunks: int,
             schedule: str) -> StepProgram:
    """The simulator's program of every rank's cached schedule (`simulate.compile_step`)."""
    return compile_step([rank_schedule(r, pp_size, num_microbatches, virtual_chunks, schedule)
                         for r in range(pp_size)], placement_of(schedule))


def step_makespan(pp_size: int, num_microbatches: int, virtual_chunks: int,
                  forward_time: float, backward_time: float, schedule: str = "1f1b") -> float:
    """`simulate.simulate_step`'s makespan (a split backward: half B, half W), replayed
    from the shape's compiled program: the same clocks, without matching the messages and
    checking the passes' order again for every layout's times (a shape replayed often:
    as straight-line code, `_replay`)."""
    shape = (pp_size, num_microbatches, virtual_chunks, schedule)
    _REPLAYS[shape] = _REPLAYS.get(shape, 0) + 1
    weight_time = backward_time / 2
    if _REPLAYS[shape] > REPLAYS_BEFORE_CODE:
        return _replay(*shape)(forward_time, backward_time, backward_time - weight_time,
                               weight_time)
    return run_step(_program(*shape), forward_time, backward_time, weight_time,
                    timelines=False).makespan


REPLAYS_BEFORE_CODE = 4
"""A shape's makespans replayed by `run_step` before it is written as code (writing and
compiling it costs ~50 replays; each replay then costs a fifth)."""
_REPLAYS: Dict[Tuple[int, int, int, str], int] = {}


@lru_cache(maxsize=8)
def _replay(pp_size: int, num_microbatches: int, virtual_chunks: int,
            schedule: str) -> Callable[[float, float, float, float], float]:
    """`run_step`'s makespan of the shape's program as one Python function of (F, B, b, W):
    each rank's clock a local, the same additions in the same order, each wait the max of
    its clock and its parties' posts (max is exact, whatever the grouping)."""
    program = _program(pp_size, num_microbatches, virtual_chunks, schedule)
    lines = ["def replay(F, B, b, W):", f" P = [0.0] * {program.slots}"]
    lines += [f" c{r} = 0.0" for r in range(program.pp_size)]
    for op in program.ops:
        if op[0] == "c":
            lines.append(f" c{op[1]} += {op[3]}")
        elif op[0] == "p":
            lines.append(f" P[{op[2]}] = c{op[1]}")
        else:
            slots = sorted({slot for parties in op[2] for slot in parties})
            if slots:
                lines.append(f" c{op[1]} = max(c{op[1]}, "
                             f"{', '.join(f'P[{slot}]' for slot in slots)})")
    clocks = ", ".join(f"c{r}" for r in range(program.pp_size))
    lines.append(f" return max([{clocks}]) if {program.pp_size} else 0.0")
    namespace: Dict[str, Callable[[float, float, float, float], float]] = {}
    exec(compile("\n".join(lines), f"<replay {program.pp_size} x {num_microbatches}>", "exec"),
         namespace)
    return namespace["replay"]


@lru_cache(maxsize=4096)
def _held_states(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int,
                 schedule: str) -> Tuple[Tuple[Tuple[int, ...], Tuple[int, ...]], ...]:
    """`held_after_each_pass` of one rank's schedule, each distinct state once, in the order
    first seen (a 1F1B rank of m micro-batches passes 2m times through at most p + 1)."""
    states = held_after_each_pass(rank_schedule(pp_rank, pp_size, num_microbatches,
                                                virtual_chunks, schedule), virtual_chunks)
    return tuple(dict.fromkeys((tuple(held), tuple(stashed)) for held, stashed in states))


def peak_held(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int,
              schedule: str, chunk_weights: Sequence[float],
              stash_weights: Sequence[float]) -> Tuple[float, List[int], List[int]]:
    """`simulate.peak_in_flight` of the rank's schedule, over its cached distinct states."""
    return peak_of_states(_held_states(pp_rank, pp_size, num_microbatches, virtual_chunks,
                                       schedule), chunk_weights, stash_weights)
