#!/usr/bin/env python
"""What the timeline (--timeline) costs: pretrain steps/s with it off and on.

    torchrun --nproc-per-node 2 bench/bench_timeline.py --pp 2   # 1F1B over two stages
    python bench/bench_timeline.py                               # one rank

The real step of `pretrain_gpt.py` (the session `training.pretrain` builds from the flags;
`loop.train_step` with the schedule's micro-batches read once into memory, so data
loading is in neither side), on a deliberately small model so that per-span costs show.
The timeline is started once (collective, untimed) and then toggled between blocks by its
one flag, `timeline.on`, which is exactly what every recording site reads: off blocks run
the code paths of a run without --timeline. Blocks alternate off/on (the first side
alternating per round) after a warm-up block each; a side's figure is the median over its
blocks, and the median of each round's on/off ratio (adjacent blocks share the machine's
load). Also reported: spans recorded per step, and the cost of one span measured alone.
At the end the ranks' spans are merged as a run would (untimed) and the trace's size shown.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

from gigatron.parallel import timeline
from gigatron.parallel.world import init_distributed, read_launch_env
from gigatron.training.run import loop
from gigatron.training.run import pretrain
from gigatron.training.run.builders import micro_batches


def _flags(args: argparse.Namespace) -> List[str]:
    return (f"--num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads 4 "
            f"--seq-length {args.seq} --max-position-embeddings {args.seq} "
            f"--micro-batch-size {args.micro_batch} --global-batch-size "
            f"{args.micro_batch * args.microbatches * args.dp} --vocab-size 1024 --mock-data "
            f"--lr 1e-4 --train-iters 100000 --hidden-dropout 0 --attention-dropout 0 "
            f"--no-progress --log-interval 100000 --eval-iters 0 "
            f"--pipeline-model-parallel-size {args.pp} --zero-stage {args.zero_stage}").split()


def build_step(args: argparse.Namespace) -> Callable[[int], None]:
    """One pretrain step over pre-read micro-batches, as pretrain_gpt.py runs it."""
    launch = read_launch_env()
    run, tokenizer = pretrain._configure(_flags(args), launch)
    launch, device = init_distributed(run.parallel.distributed_timeout_minutes)
    session, progress, _ = pretrain._build_session(run, tokenizer, launch, device)
    it = micro_batches(run, session.datasets[0], 0, session.groups.index("dp"), device,
                       session.pipeline)
    n = run.train.num_microbatches
    batches = [[next(it) for _ in range(n)] for _ in range(4)]

    def step(i: int) -> None:
        outcome = loop.train_step(session, batches[i % len(batches)], progress)
        loop.advance(progress, outcome, run.train.global_batch_size)
    return step


def _block(step: Callable[[int], None], start: int, n: int) -> Tuple[float, float]:
    """(wall ms, this process's CPU ms) per step over `n` steps."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(start, start + n):
        step(i)
    return (1000 * (time.perf_counter() - wall) / n, 1000 * (time.process_time() - cpu) / n)


def _span_cost_ns(n: int = 200_000) -> float:
    """ns of one `record` (a clock read, the thread's row, a tuple into the list)."""
    began = time.perf_counter_ns()
    for _ in range(n):
        timeline.record("x", timeline.now())
    return (time.perf_counter_ns() - began) / n


def _spans_per_step(step: Callable[[int], None], start: int, n: int) -> float:
    rec = timeline._rec
    assert rec is not None
    timeline.flush()
    step_range = range(start, start + n)
    for i in step_range:
        step(i)
    return len(rec.events) / n


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--layers", type=int, default=2)
    add("--hidden", type=int, default=64)
    add("--seq", type=int, default=64)
    add("--micro-batch", type=int, default=2)
    add("--microbatches", type=int, default=8)
    add("--pp", type=int, default=1)
    add("--zero-stage", type=int, default=1)
    add("--rounds", type=int, default=15)
    add("--block", type=int, default=4, help="steps per timed block")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world = read_launch_env().world_size
    args.dp = world // args.pp
    step = build_step(args)
    rank = torch.distributed.get_rank()
    path = os.path.join(tempfile.mkdtemp(prefix="bench_timeline_"), "t.json")
    timeline.start(path)
    times: Dict[bool, List[Tuple[float, float]]] = {False: [], True: []}
    i = 0
    for on in (False, True):  # warm-up, untimed
        timeline.on = on
        _block(step, i, args.block)
        i += args.block
    for r in range(args.rounds):
        for on in ((False, True) if r % 2 == 0 else (True, False)):
            timeline.on = on
            times[on].append(_block(step, i, args.block))
            i += args.block
    timeline.on = True
    spans = _spans_per_step(step, i, args.block)
    _report(args, world, times, spans, rank)
    written = timeline.finish(collective=True)
    if rank == 0:
        print(f"trace: {written}, {os.path.getsize(written) / 1024:.0f} KiB for "
              f"{2 + 2 * args.rounds + 1} x {args.block} steps")
    _print_span_cost(rank)
    torch.distributed.destroy_process_group()
    return 0


def _print_span_cost(rank: int) -> None:
    """One span's recording cost, on a recorder of its own (a world-of-one start)."""
    folder = tempfile.mkdtemp(prefix="bench_timeline_span_")
    rec = timeline._Recorder(os.path.join(folder, "t.json"), rank, 1)
    timeline._rec = rec
    try:
        on_ns = _span_cost_ns()
    finally:
        timeline._rec = None
    began, n = time.perf_counter_ns(), 1_000_000
    for _ in range(n):
        if timeline.on:
            pass
    off_ns = (time.perf_counter_ns() - began) / n
    if rank == 0:
        print(f"one span: {on_ns:.0f} ns to record and write (JSON batches amortised); the "
              f"off check (`if timeline.on`): {off_ns:.0f} ns including the loop")


def _report(args: argparse.Namespace, world: int,
            times: Dict[bool, List[Tuple[float, float]]], spans: float, rank: int) -> None:
    if rank != 0:
        return
    wall = {on: [w for w, _ in times[on]] for on in times}
    cpu = {on: statistics.median(c for _, c in times[on]) for on in times}
    off, on = statistics.median(wall[False]), statistics.median(wall[True])
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, micro-batch "
          f"{args.micro_batch} x {args.microbatches}; {world} rank(s): pp {args.pp} dp "
          f"{args.dp}, ZeRO {args.zero_stage}; CPU, 1 thread per rank; {args.rounds} rounds x "
          f"{args.block} steps per side")
    for name, key in (("off", False), ("on", True)):
        ms = wall[key]
        print(f"timeline {name:3s}: median {statistics.median(ms):7.2f} ms/step "
              f"({1000 / statistics.median(ms):6.1f} steps/s; blocks {min(ms):.2f}-"
              f"{max(ms):.2f}), {cpu[key]:7.2f} ms CPU/step (rank 0)")
    paired = statistics.median(a / b for a, b in zip(wall[True], wall[False]))
    print(f"overhead: {100 * (on / off - 1):+.2f}% wall (median of the rounds' on/off ratios: "
          f"{100 * (paired - 1):+.2f}%), {100 * (cpu[True] / cpu[False] - 1):+.2f}% CPU "
          f"({spans:.0f} spans per step on rank 0)")


if __name__ == "__main__":
    sys.exit(main())
