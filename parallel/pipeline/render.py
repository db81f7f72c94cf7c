"""Draw pipeline schedules as a per-rank text time grid, so a user sees the bubble.

    gigatron schedule --pp 4 --num-microbatches 8 --virtual-chunks 2
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from .schedules import (BATCH_FLAGS, PP_FLAG, VIRTUAL_FLAG, Backward, Forward, Instruction, WeightGrad,
                        build_schedule)
from .simulate import simulate


def _cell(step: Instruction, virtual_chunks: int, width: int) -> str:
    letter = {Forward: "F", Backward: "B", WeightGrad: "W"}[type(step)]
    chunk = f"{'abcdefghijklmnopqrstuvwxyz'[step.chunk]}" if virtual_chunks > 1 else ""
    return f"{letter}{step.microbatch}{chunk}".ljust(width)[:width]


def render(schedules: Sequence[Sequence[Instruction]], forward_time: int = 1,
           backward_time: int = 2) -> str:
    """A per-rank text time grid: F3 / B3 = micro-batch 3 (a, b.. = chunk), '.' = bubble."""
    result = simulate(schedules, forward_time, backward_time)
    virtual_chunks = 1 + max((s.chunk for sched in schedules for s in sched
                              if isinstance(s, (Forward, Backward))), default=0)
    width = 2 + len(str(max((s.microbatch for sched in schedules for s in sched
                             if isinstance(s, Forward)), default=0))) + (virtual_chunks > 1)
    slots = int(round(result.makespan))
    lines = []
    for r, timeline in enumerate(result.timelines):
        row = ["." * width] * slots
        for start, end, step in timeline:
            for t in range(int(start), int(end)):
                row[t] = _cell(step, virtual_chunks, width)
        lines.append(f"stage {r}: |" + "|".join(row) + f"|  bubble "
                     f"{result.bubble_fraction(r):.1%}")
    lines.append(f"bubble: share of the step a stage sits idle ('.'), simulated with backward = "
                 f"{backward_time / forward_time:g} x forward and free communication (a model of "
                 f"the schedule, not a measurement)")
    return "\n".join(lines)


# the schedule's errors name pretrain's flags; here the user typed this command's flags
_OWN_FLAGS = ((f"({BATCH_FLAGS} = ", "(--num-microbatches "), (BATCH_FLAGS, "--num-microbatches"),
              (VIRTUAL_FLAG, "--virtual-chunks"), (PP_FLAG, "--pp"),
              ("change --global-batch-size or drop --virtual-chunks",
               "change --num-microbatches or use --virtual-chunks 1"))


def _in_own_flags(message: str) -> str:
    for theirs, ours in _OWN_FLAGS:
        message = message.replace(theirs, ours)
    return message


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print one schedule for every stage (`gigatron schedule`)."""
    parser = argparse.ArgumentParser(description="Print a pipeline schedule as a time grid.",
                                     allow_abbrev=False)
    parser.add_argument("--pp", "--pipeline-model-parallel-size", type=int, required=True,
                        dest="pp", help="pipeline stages")
    parser.add_argument("--num-microbatches", type=int, required=True,
                        help="micro-batches per step")
    parser.add_argument("--virtual-chunks", type=int, default=1,
                        help="model chunks per stage (interleaved schedule when > 1) (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.pp < 1:
        parser.exit(2, f"error: --pp must be >= 1, got {args.pp}\n")
    try:
        schedules = [build_schedule(r, args.pp, args.num_microbatches, args.virtual_chunks)
                     for r in range(args.pp)]
    except ValueError as err:
        parser.exit(2, f"error: {_in_own_flags(str(err))}\n")
    print(render(schedules))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
