"""Batch-size ramp-up and samples-based training, as Megatron computes them (pure functions).

`--rampup-batch-size START INCREMENT SAMPLES` grows the global batch from START by INCREMENT
in (global - START) / INCREMENT equal shares of SAMPLES samples: after `consumed` samples the
batch is START + INCREMENT x int(consumed / (SAMPLES / increments)), and the full global batch
once more than SAMPLES samples are consumed. Each iteration runs batch / (micro x dp)
micro-batches and consumes batch samples; the lr schedule advances by the same count.

`--train-samples N` trains for as many iterations as Megatron's update_train_iters counts:
N // global batch without a ramp; with one, iterations are counted through the ramp (while
consumed <= SAMPLES and consumed <= N) and the rest at the full batch, a partial last batch
dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Sequence

if TYPE_CHECKING:
    from gigatron.training.config.run_config import TrainConfig


@dataclass(frozen=True)
class BatchRampup:
    """The global batch of every iteration: constant, or ramped up over the first samples."""

    global_batch_size: int
    micro_batch_times_dp: int  # micro batch x data-parallel size
    start: Optional[int] = None  # None: no ramp-up
    increment: int = 0
    samples: int = 0

    @property
    def ramps(self) -> bool:
        return self.start is not None and self.start != self.global_batch_size

    def batch_size(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples`."""
        if not self.ramps or consumed_samples > self.samples:
            return self.global_batch_size
        assert self.start is not None
        increments = (self.global_batch_size - self.start) // self.increment
        samples_per_increment = self.samples / increments
        return self.start + int(consumed_samples / samples_per_increment) * self.increment

    def num_microbatches(self, consumed_samples: int) -> int:
        """Micro-batches per data-parallel rank of the iteration after `consumed_samples`."""
        return self.batch_size(consumed_samples) // self.micro_batch_times_dp

    def consumed_after(self, iterations: int) -> int:
        """Samples consumed by the first `iterations` iterations."""
        consumed = done = 0
        while done < iterations and self.ramps and consumed <= self.samples:
            consumed += self.batch_size(consumed)
            done += 1
        return consumed + (iterations - done) * self.global_batch_size

    def batch_sizes(self) -> List[int]:
        """Every global batch the ramp passes through, in order (ends at the full batch)."""
        if not self.ramps:
            return [self.global_batch_size]
        assert self.start is not None
        return list(range(self.start, self.global_batch_size + 1, self.increment))


def rampup_problems(values: Sequence[int], global_batch_size: int,
                    micro_batch_times_dp: int) -> List[str]:
    """Why --rampup-batch-size VALUES cannot run (Megatron's checks, and each batch of the
    ramp divisible by micro batch x data-parallel size, which Megatron asserts at run time)."""
    if len(values) != 3:
        return [f"--rampup-batch-size takes three numbers START INCREMENT SAMPLES, got "
                f"{len(values)}: e.g. --rampup-batch-size 16 16 5859375"]
    start, increment, samples = values
    out = []
    if start <= 0 or increment <= 0 or samples <= 0:
        out.append(f"--rampup-batch-size {start} {increment} {samples}: START, INCREMENT and "
                   f"SAMPLES must be > 0")
        return out
    diff = global_batch_size - start
    if diff < 0:
        out.append(f"--rampup-batch-size START {start} is larger than --global-batch-size "
                   f"{global_batch_size}: lower START")
    elif diff % increment:
        out.append(f"--global-batch-size {global_batch_size} - START {start} = {diff} is not "
                   f"a multiple of INCREMENT {increment}: change --rampup-batch-size")
    else:
        bad = [b for b in range(start, global_batch_size + 1, increment)
               if b % micro_batch_times_dp]
        if bad:
            out.append(f"--rampup-batch-size passes through global batches {bad[:4]} that are "
                       f"not multiples of --micro-batch-size x data-parallel size = "
                       f"{micro_batch_times_dp}: change START or INCREMENT")
    return out


def build_rampup(values: Optional[Sequence[int]], global_batch_size: int,
                 micro_batch_times_dp: int) -> BatchRampup:
    """The ramp of valid --rampup-batch-size values (None: a constant global batch)."""
    if not values:
        return BatchRampup(global_batch_size, micro_batch_times_dp)
    start, increment, samples = values
    return BatchRampup(global_batch_size, micro_batch_times_dp, start, increment, samples)


def run_rampup(train: "TrainConfig", dp: int) -> BatchRampup:
    """The ramp of a validated run's TrainConfig on `dp` data-parallel ranks."""
    assert train.global_batch_size is not None and train.micro_batch_size is not None
    return build_rampup(train.rampup_batch_size, train.global_batch_size,
                        train.micro_batch_size * dp)


def train_iters_from_samples(train_samples: int, ramp: BatchRampup) -> int:
    """Iterations of --train-samples (Megatron's update_train_iters)."""
    if ramp.start is None:
        return train_samples // ramp.global_batch_size
    iterations = consumed = 0
    while consumed <= ramp.samples and consumed <= train_samples:
        consumed += ramp.batch_size(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // ramp.global_batch_size
    return iterations


def iterations_to_consume(samples: int, ramp: BatchRampup) -> int:
    """The fewest iterations after which at least `samples` samples are consumed (the
    iteration that crosses the mark runs whole, as Megatron-DeepSpeed's --train-tokens loop
    stops only between iterations)."""
    iterations = consumed = 0
    while consumed < samples and ramp.ramps and consumed <= ramp.samples:
        consumed += ramp.batch_size(consumed)
        iterations += 1
    if consumed < samples:
        iterations += -(-(samples - consumed) // ramp.global_batch_size)
    return iterations
