#!/usr/bin/env python
"""gigatron's training step vs a plain PyTorch loop: same model, same data, one CPU rank.

    python bench/bench_overhead.py     # 4 layers x hidden 256, seq 256, 2 micro-batches
    python bench/bench_overhead.py --rounds 4 --block 3 --hidden 128   # a quick look

gigatron side: the real step of `pretrain_gpt.py` (the session `training.pretrain` builds
from the flags: pipeline executor with the no-pipelining schedule, ZeRO stage 0, lr
schedule, timers, then `loop.train_step` + `loop.advance` + the interval's metrics
accumulation). Plain side: the same `GPTModel` class with the same seed, the same
micro-batches (read once from the gigatron data iterator into memory, so data loading is
in neither), gradient accumulation by `loss / n`.backward(), `clip_grad_norm_` (gigatron
clips too: --clip-grad, Megatron's default 1.0) and `torch.optim.AdamW` (same lr, betas,
eps, weight decay). Dropout is 0 on both sides.

Timing is interleaved: `--rounds` rounds, each one block of `--block` iterations per side,
the side that goes first alternating, after one warm-up block each; a side's figure is the
median over its blocks of ms per iteration, so load on the shared machine hits both alike.
Wall time and process CPU time are both reported: on a shared machine the CPU time is not
inflated by this process waiting for a core.

Host syncs: afterwards one more block per side runs under `HostSyncCounter`
(gigatron/training/observe/host_syncs.py): every Tensor.item/tolist/numpy/__bool__/__float__/
__int__/__index__/__format__ call and device synchronise made from code outside torch is
counted (torch.optim's reads of its host-side step counters are torch's own and happen in
both loops). The per-step count between log lines is printed (target 0).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, List, Tuple

import torch

from gigatron.models.gpt import GPTModel
from gigatron.parallel.world import init_distributed, read_launch_env
from gigatron.models.losses import masked_mean_loss
from gigatron.training.run import loop
from gigatron.training.run import pretrain
from gigatron.training.run.builders import micro_batches
from gigatron.training.observe.host_syncs import HostSyncCounter


def _flags(args: argparse.Namespace) -> List[str]:
    return (f"--num-layers {args.layers} --hidden-size {args.hidden} --num-attention-heads "
            f"{args.heads} --seq-length {args.seq} --max-position-embeddings {args.seq} "
            f"--micro-batch-size {args.micro_batch} --global-batch-size "
            f"{args.micro_batch * args.microbatches} --vocab-size {args.vocab} --mock-data "
            f"--lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine --lr-warmup-iters 2 "
            f"--train-iters 100000 --clip-grad {args.clip_grad} --weight-decay 0.1 "
            f"--hidden-dropout 0 --attention-dropout 0 --no-progress --log-interval 1000 "
            f"--eval-iters 0").split()


def gigatron_step(args: argparse.Namespace):
    """The session pretrain_gpt.py would build, its micro-batches, and one-step closure."""
    launch = read_launch_env()
    run, tokenizer = pretrain._configure(_flags(args), launch)
    launch, device = init_distributed(run.parallel.distributed_timeout_minutes)
    session, progress, _ = pretrain._build_session(run, tokenizer, launch, device)
    it = micro_batches(run, session.datasets[0], 0, 0, device, session.pipeline)
    n = run.train.num_microbatches
    steps = [[next(it) for _ in range(n)] for _ in range(args.distinct_batches)]
    interval = loop._Interval()

    def step(i: int) -> None:
        outcome = loop.train_step(session, steps[i % len(steps)], progress)
        loop.advance(progress, outcome, run.train.global_batch_size)
        interval.add(outcome, run.train.global_batch_size)
    return run, steps, step


def plain_step(run, steps) -> Callable[[int], None]:
    """A plain PyTorch loop over the same model class and batches."""
    model = GPTModel(run.model, seed=run.train.seed)
    z = run.zero
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": z.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=z.lr, betas=(z.adam_beta1, z.adam_beta2), eps=z.adam_eps)

    def step(i: int) -> None:
        batches = steps[i % len(steps)]
        opt.zero_grad(set_to_none=True)
        for b in batches:
            per_token = model(input_ids=b["input_ids"], position_ids=b["position_ids"],
                              labels=b["labels"])
            (masked_mean_loss(per_token, b) / len(batches)).backward()
        if z.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), z.clip_grad)
        opt.step()
    return step


def _block(step: Callable[[int], None], start: int, n: int) -> Tuple[float, float]:
    """(wall ms, process CPU ms) per iteration over `n` iterations."""
    wall, cpu = time.perf_counter(), time.process_time()
    for i in range(start, start + n):
        step(i)
    return (1000 * (time.perf_counter() - wall) / n, 1000 * (time.process_time() - cpu) / n)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    add = parser.add_argument
    add("--layers", type=int, default=4)
    add("--hidden", type=int, default=256)
    add("--heads", type=int, default=8)
    add("--seq", type=int, default=256)
    add("--vocab", type=int, default=8192)
    add("--micro-batch", type=int, default=4)
    add("--microbatches", type=int, default=2)
    add("--clip-grad", type=float, default=1.0)
    add("--rounds", type=int, default=20)
    add("--block", type=int, default=2, help="iterations per timed block")
    add("--distinct-batches", type=int, default=4)
    add("--threads", type=int, default=1, help="torch intra-op threads (1: least noise)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("MASTER_PORT", "29517")
    run, steps, ours = gigatron_step(args)
    plain = plain_step(run, steps)
    sides = {"gigatron": ours, "plain": plain}
    times = {name: [] for name in sides}
    it = {name: 0 for name in sides}
    for name, step in sides.items():  # warm-up block, not timed
        _block(step, 0, args.block)
        it[name] = args.block
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(sides)[::-1]
        for name in order:
            times[name].append(_block(sides[name], it[name], args.block))
            it[name] += args.block
    syncs = {}
    for name, step in sides.items():
        with HostSyncCounter() as counter:
            _block(step, it[name], args.block)
        syncs[name] = (counter.count / args.block, dict(counter.sites))
    print(f"model: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, vocab "
          f"{args.vocab}, micro-batch {args.micro_batch} x {args.microbatches}; fp32, 1 rank, "
          f"CPU, {args.threads} thread(s); {args.rounds} rounds x {args.block} iterations")
    med = {}
    for name in sides:
        wall, cpu = [w for w, _ in times[name]], [c for _, c in times[name]]
        med[name] = (statistics.median(wall), statistics.median(cpu))
        print(f"{name:9s} median {med[name][0]:8.1f} ms/iteration wall (blocks "
              f"{min(wall):.1f}-{max(wall):.1f}), {med[name][1]:8.1f} ms CPU; host syncs per "
              f"step {syncs[name][0]:g}")
    print(f"ratio gigatron / plain: {med['gigatron'][0] / med['plain'][0]:.3f} wall, "
          f"{med['gigatron'][1] / med['plain'][1]:.3f} CPU time (target <= 1.03)")
    for site, count in syncs["gigatron"][1].items():
        print(f"  gigatron host sync: {site} x{count}")
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
