"""Draw pipeline schedules as a per-rank text time grid, so a user sees the bubble.

    gigatron schedule --pp 4 --num-microbatches 8 --virtual-chunks 2
    gigatron schedule --schedule zbv --pp 4 --num-microbatches 8 --json
"""
from __future__ import annotations

import argparse
import json
from typing import Optional, Sequence, Tuple

from .schedules import (BATCH_FLAGS, PP_FLAG, SCHEDULE_FLAG, SCHEDULES, VIRTUAL_FLAG, Backward,
                        Forward, Instruction, WeightGrad, build_schedule, placement_of)
from .simulate import SimulationResult, held_after_each_pass, simulate


def _cell(step: Instruction, virtual_chunks: int, width: int) -> str:
    letter = {Forward: "F", Backward: "B", WeightGrad: "W"}[type(step)]
    chunk = f"{'abcdefghijklmnopqrstuvwxyz'[step.chunk]}" if virtual_chunks > 1 else ""
    return f"{letter}{step.microbatch}{chunk}".ljust(width)[:width]


def _cost_model(schedules: Sequence[Sequence[Instruction]], backward_time: float,
                forward_time: float) -> str:
    """The stated cost model, in words: split schedules time B and W as half a backward."""
    if any(isinstance(s, WeightGrad) for sched in schedules for s in sched):
        return (f"B = W = {backward_time / forward_time / 2:g} x F (a backward of "
                f"{backward_time / forward_time:g} x F split in two)")
    return f"backward = {backward_time / forward_time:g} x forward"


def render(schedules: Sequence[Sequence[Instruction]], forward_time: int = 1,
           backward_time: int = 2, placement: str = "loop") -> str:
    """A per-rank text time grid: F3 / B3 / W3 = micro-batch 3's forward, (input-grad)
    backward, weight-grad pass (a, b.. = chunk), '.' = bubble."""
    result = simulate(schedules, forward_time, backward_time, placement=placement)
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
    lines.append(f"bubble: share of the step a stage sits idle ('.'), simulated with "
                 f"{_cost_model(schedules, backward_time, forward_time)} and free "
                 f"communication (a model of the schedule, not a measurement)")
    return "\n".join(lines)


def _stage_held(schedule: Sequence[Instruction], virtual_chunks: int) -> Tuple[float, float]:
    """(the most micro-batches' activations the stage holds at once, the W stashes it holds
    with them), in whole-stage micro-batches."""
    return max(((sum(held) / virtual_chunks, sum(stashed) / virtual_chunks)
                for held, stashed in held_after_each_pass(schedule, virtual_chunks)),
               default=(0.0, 0.0))


def summary(schedules: Sequence[Sequence[Instruction]], result: SimulationResult,
            virtual_chunks: int) -> dict:
    """`gigatron schedule --json`: the bubble and the activation memory of one step."""
    held = [_stage_held(s, virtual_chunks) for s in schedules]
    return {"bubble_fraction": round(result.mean_bubble_fraction(), 6),
            "bubble_fraction_per_stage": [round(result.bubble_fraction(r), 6)
                                          for r in range(len(schedules))],
            "peak_activations": max(a for a, _ in held),
            "peak_activations_per_stage": [a for a, _ in held],
            "w_stash_per_stage": [w for _, w in held],
            "step_time": result.makespan,
            "cost_model": _cost_model(schedules, 2, 1) + ", free communication; "
                          "activations in whole-stage micro-batches, held from F to B; a "
                          "split backward then holds the micro-batch's W stash (its linears' "
                          "inputs and output gradients, ~32sbh per layer against 34sbh + "
                          "5as^2b of activations, Qi et al.) until W: w_stash_per_stage, "
                          "held at the stage's activation peak"}


# the schedule's errors name pretrain's flags; here the user typed this command's flags
_OWN_FLAGS = ((f"({BATCH_FLAGS} = ", "(--num-microbatches "), (BATCH_FLAGS, "--num-microbatches"),
              (VIRTUAL_FLAG, "--virtual-chunks"), (PP_FLAG, "--pp"),
              (SCHEDULE_FLAG, "--schedule"),
              ("change --global-batch-size or drop --virtual-chunks",
               "change --num-microbatches or use --virtual-chunks 1"))


def _in_own_flags(message: str) -> str:
    for theirs, ours in _OWN_FLAGS:
        message = message.replace(theirs, ours)
    return message


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Print a pipeline schedule as a time grid.",
                                     allow_abbrev=False)
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                        help="which schedule (1f1b: interleaved when --virtual-chunks > 1) "
                             "(default: %(default)s)")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", type=int, required=True,
                        dest="pp", help="pipeline stages")
    parser.add_argument("--num-microbatches", type=int, required=True,
                        help="micro-batches per step")
    parser.add_argument("--virtual-chunks", type=int, default=None,
                        help="model chunks per stage (interleaved schedule when > 1) "
                             "(default: 2 for zbv, else 1)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (bubble_fraction, peak_activations, "
                             "w_stash_per_stage)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print one schedule for every stage (`gigatron schedule`)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.pp < 1:
        parser.exit(2, f"error: --pp must be >= 1, got {args.pp}\n")
    virtual = args.virtual_chunks or (2 if args.schedule == "zbv" else 1)
    try:
        schedules = [build_schedule(r, args.pp, args.num_microbatches, virtual,
                                    schedule=args.schedule) for r in range(args.pp)]
    except ValueError as err:
        parser.exit(2, f"error: {_in_own_flags(str(err))}\n")
    placement = placement_of(args.schedule)
    if args.json:
        result = simulate(schedules, placement=placement)
        print(json.dumps({"schedule": args.schedule, "pp": args.pp,
                          "num_microbatches": args.num_microbatches,
                          "virtual_chunks": virtual,
                          **summary(schedules, result, virtual)}))
    else:
        print(render(schedules, placement=placement))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
