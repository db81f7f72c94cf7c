"""The training loop: steps through the pipeline schedule, evaluation, logging, checkpoints.

One iteration: set the lr from the schedule's position, zero grads, run the step's
micro-batches through the pipeline executor (ZeRO is its grad_sync hook and its optimizer
step), reduce the loss for logging. A skipped step (fp16 overflow) still consumes its
samples but does not advance the lr schedule (Megatron's rule).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch

from gigatron.parallel import comm
from gigatron.training import state as checkpoint_state
from gigatron.training.builders import Pipeline, micro_batches
from gigatron.training.config import RunConfig
from gigatron.training.logger import MetricsLogger
from gigatron.training.lr_schedule import learning_rate
from gigatron.training.metrics import peak_memory_bytes, throughput
from gigatron.training.state import TrainProgress
from gigatron.training.timers import Timers


@dataclass
class Session:
    """Everything the loop works with, built once by pretrain_gpt.py."""

    run: RunConfig
    groups: Any  # ProcessGroups
    device: torch.device
    chunks: List[torch.nn.Module]
    zero: Any  # ZeroOptimizer
    pipeline: Pipeline
    datasets: List[Optional[object]]  # train, valid, test
    logger: MetricsLogger
    timers: Timers
    flops_per_token: float
    peak_tflops: Optional[float]
    saved_iterations: List[int] = field(default_factory=list)


@dataclass
class StepOutcome:
    loss: float
    lr: float
    grad_norm: Optional[float]
    loss_scale: float
    skipped: bool


class ExitSignal:
    """SIGTERM sets a flag; every rank learns at the same iteration if any rank got it."""

    def __init__(self, enabled: bool, device: torch.device) -> None:
        self.enabled, self.received, self.device = enabled, False, device
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True

    def any_rank(self) -> bool:
        if not self.enabled:
            return False
        return comm.all_reduce_scalar(float(self.received), op=comm.ReduceOp.MAX,
                                      device=self.device) > 0


def _global_mean(local: Optional[float], s: Session) -> float:
    """The step's loss on every rank: last-stage values averaged over dp, sent along pp.
    The reductions run on the session's device: NCCL takes no CPU tensors."""
    value = local if s.pipeline.needs_labels and local is not None else 0.0
    mean = comm.all_reduce_scalar(value, group=s.groups.dp, device=s.device) / s.run.parallel.dp
    return comm.all_reduce_scalar(mean, group=s.groups.pp, device=s.device)


def _next_batches(it: Iterator[dict], n: int, timers: Optional[Timers] = None) -> List[dict]:
    if timers is not None:
        timers.start("data")
    batches = [next(it) for _ in range(n)]
    if timers is not None:
        timers.stop("data")
    return batches


def train_step(s: Session, batches: List[dict], progress: TrainProgress) -> StepOutcome:
    """One optimizer step over the global batch (this rank's micro-batches)."""
    lr = learning_rate(progress.lr_steps, s.run.lr_schedule)
    s.zero.set_lr(lr)
    s.zero.zero_grad()
    result: Dict[str, Any] = {}

    def optimizer_step() -> None:
        s.timers.start("optimizer")
        result["step"] = s.zero.step()
        s.timers.stop("optimizer")

    losses = s.pipeline.executor.run(s.pipeline.train_schedule, batches,
                                     loss_scale=s.zero.loss_scale,
                                     optimizer_step=optimizer_step)
    step = result["step"]  # every training schedule ends with OptimizerStep
    local = torch.stack(losses).mean().item() if losses else None
    return StepOutcome(_global_mean(local, s), lr, step.grad_norm, step.loss_scale, step.skipped)


def evaluate(s: Session, split: int, consumed: int, iterations: int) -> Optional[float]:
    """Mean lm loss over `iterations` global batches of split 0/1/2 from sample `consumed`."""
    dataset = s.datasets[split]
    if dataset is None or iterations == 0:
        return None
    it = micro_batches(s.run, dataset, consumed, s.groups.index("dp"), s.device, s.pipeline)
    for chunk in s.chunks:
        chunk.eval()
    total, timed = 0.0, dict(s.timers.elapsed)  # eval forwards are not the step's
    try:
        with torch.no_grad():
            for _ in range(iterations):
                batches = _next_batches(it, s.run.train.num_microbatches)
                losses = s.pipeline.executor.run(s.pipeline.eval_schedule, batches)
                local = torch.stack(losses).mean().item() if losses else None
                total += _global_mean(local, s)
    finally:
        for chunk in s.chunks:
            chunk.train()
        s.timers.elapsed.clear()
        s.timers.elapsed.update(timed)
    return total / iterations


class _Interval:
    """What accumulates between two log lines."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.losses: List[float] = []
        self.skipped = 0

    def add(self, outcome: StepOutcome) -> None:
        self.losses.append(outcome.loss)
        self.skipped += int(outcome.skipped)


def _log(s: Session, progress: TrainProgress, outcome: StepOutcome, interval: _Interval) -> None:
    elapsed = time.perf_counter() - interval.start
    n = len(interval.losses)
    t = s.run.train
    tokens = n * t.global_batch_size * s.run.model.seq_length
    rates = throughput(tokens, elapsed, s.flops_per_token, s.run.parallel.world_size,
                       s.peak_tflops)
    memory = comm.all_reduce_scalar(peak_memory_bytes(s.device), op=comm.ReduceOp.MAX,
                                    device=s.device)
    phases = s.timers.reset()
    accounted = sum(phases.values())
    record = {
        "iteration": progress.iteration, "consumed_samples": progress.consumed_train_samples,
        "lm loss": sum(interval.losses) / n, "lr": outcome.lr, "grad norm": outcome.grad_norm,
        "loss scale": outcome.loss_scale, "skipped": interval.skipped,
        "global_batch_size": t.global_batch_size, "ms_per_iteration": 1000 * elapsed / n,
        **rates, "peak_memory_mib": memory / 2 ** 20,
        "timers_ms": {name: 1000 * sec / n for name, sec in sorted(phases.items())},
    }
    if "forward" in phases:  # backward is what the measured phases leave of the step
        record["timers_ms"]["backward"] = max(0.0, 1000 * (elapsed - accounted) / n)
    s.logger.train(record)


def _save(s: Session, progress: TrainProgress) -> None:
    if s.run.checkpoint.save is None or progress.iteration in s.saved_iterations:
        return
    start = time.perf_counter()
    folder = checkpoint_state.save(s.run, s.groups, progress, s.chunks, s.zero, s.device)
    s.saved_iterations.append(progress.iteration)
    seconds = time.perf_counter() - start
    s.logger.print(f"saved checkpoint at iteration {progress.iteration:7d} to {folder} "
                   f"({seconds:.1f} s)")
    s.logger.event({"type": "checkpoint", "iteration": progress.iteration, "path": folder,
                    "seconds": seconds})


def _evaluate_and_log(s: Session, progress: TrainProgress, split: int, name: str) -> None:
    t = s.run.train
    consumed = progress.consumed_valid_samples if split == 1 else 0
    loss = evaluate(s, split, consumed, t.eval_iters)
    if loss is None:
        return
    if split == 1:
        progress.consumed_valid_samples += t.eval_iters * t.global_batch_size
    s.logger.evaluation({"split": name, "iteration": progress.iteration, "lm loss": loss})


def train(s: Session, progress: TrainProgress) -> TrainProgress:
    """Train from `progress` to --train-iters (or an exit condition); returns the progress."""
    t, ck = s.run.train, s.run.checkpoint
    it = micro_batches(s.run, s.datasets[0], progress.consumed_train_samples,
                       s.groups.index("dp"), s.device, s.pipeline)
    exit_signal = ExitSignal(t.exit_signal_handler, s.device)
    interval = _Interval()
    while progress.iteration < t.train_iters:
        outcome = train_step(s, _next_batches(it, t.num_microbatches, s.timers), progress)
        progress.iteration += 1
        progress.consumed_train_samples += t.global_batch_size
        if outcome.skipped:
            progress.skipped_iterations += 1
        else:
            progress.lr_steps += t.global_batch_size
        interval.add(outcome)
        s.logger.progress(progress.iteration, outcome.loss)
        if progress.iteration % s.run.logging.log_interval == 0:
            _log(s, progress, outcome, interval)
            interval = _Interval()
        paused = time.perf_counter()  # eval and saving are not the interval's step time
        if t.eval_iters and progress.iteration % t.eval_interval == 0:
            _evaluate_and_log(s, progress, 1, "valid")
        if ck.save_interval and progress.iteration % ck.save_interval == 0:
            _save(s, progress)
        interval.start += time.perf_counter() - paused
        if exit_signal.any_rank():
            s.logger.print(f"exiting on SIGTERM at iteration {progress.iteration}")
            _save(s, progress)
            return progress
        if t.exit_interval and progress.iteration % t.exit_interval == 0:
            s.logger.print(f"exiting at iteration {progress.iteration} (--exit-interval)")
            _save(s, progress)
            return progress
    _save(s, progress)
    if not t.skip_test:
        _evaluate_and_log(s, progress, 2, "test")
    return progress
