"""How long to train and the lr schedule, from Megatron's flags: by iterations or by samples.

Iteration-based (--train-iters): lengths are iterations x global batch, and the sample-based
flags are refused. Sample-based (--train-samples): lengths are samples (--lr-decay-samples,
--lr-warmup-samples, --lr-wsd-decay-samples), --rampup-batch-size may grow the batch, the
iteration flags are refused, and the iterations are counted as Megatron counts them
(`batch_rampup.train_iters_from_samples`). --lr-warmup-fraction is a fraction of the decay in
either mode, kept as a float (Megatron does not round it).

A ramp with --train-iters (Megatron-LM's own GPT-3 175B example passes both, which Megatron
refuses since 2020) is accepted here: the batch ramps over the consumed samples as it would
by samples, --train-iters iterations run, and the lr lengths stay iterations x global batch;
the banner says so (`operational_flags.flag_notes`).
"""
from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, List, Optional, Tuple

from gigatron.training.batch_rampup import (BatchRampup, build_rampup, rampup_problems,
                                            train_iters_from_samples)
from gigatron.training.config import LRScheduleConfig
from gigatron.training.lr_schedule import validate_schedule

if TYPE_CHECKING:
    from gigatron.training.validation import Problems

# flag dests that belong to one mode, each with the flag of the other mode to use instead
_ITERATION_ONLY = (("lr_decay_iters", "--lr-decay-samples"),
                   ("lr_warmup_iters", "--lr-warmup-samples"),
                   ("lr_wsd_decay_iters", "--lr-wsd-decay-samples"))
_SAMPLE_ONLY = (("lr_decay_samples", "--lr-decay-iters"),
                ("lr_warmup_samples", "--lr-warmup-iters"),
                ("lr_wsd_decay_samples", "--lr-wsd-decay-iters"))


def _given(flags: argparse.Namespace, dest: str) -> bool:
    value = getattr(flags, dest)
    return value not in (None, 0)


def _mode_problems(flags: argparse.Namespace) -> List[str]:
    """Flags of the other mode (Megatron asserts each of them)."""
    from gigatron.training.config_table import flag_name

    if flags.train_iters is not None and flags.train_samples is not None:
        return ["--train-iters and --train-samples are exclusive: train by iterations or by "
                "samples"]
    if flags.train_iters is None and flags.train_samples is None:
        return ["--train-iters or --train-samples is required"]
    samples = flags.train_samples is not None
    wrong = _ITERATION_ONLY if samples else _SAMPLE_ONLY
    out = []
    for dest, instead in wrong:  # (the ramp is accepted with --train-iters too: see above)
        if _given(flags, dest):
            mode = "--train-samples (sample-based)" if samples else \
                "--train-iters (iteration-based)"
            out.append(f"{flag_name(dest)} does not apply with {mode}: use {instead}")
    return out


def training_length(flags: argparse.Namespace, micro_batch_times_dp: int,
                    global_batch_size: int, p: "Problems") -> Optional[Tuple[int, BatchRampup]]:
    """(iterations to train, the batch ramp); None with the problems recorded."""
    n = len(p.lines)
    p.positive(flags, "train_iters", "train_samples")
    p.lines += _mode_problems(flags)
    values = flags.rampup_batch_size
    if values:
        p.lines += rampup_problems(values, global_batch_size, micro_batch_times_dp)
    if len(p.lines) > n:
        return None
    ramp = build_rampup(values, global_batch_size, micro_batch_times_dp)
    if flags.train_iters is not None:
        return flags.train_iters, ramp
    iterations = train_iters_from_samples(flags.train_samples, ramp)
    if iterations < 1:
        p.add(f"--train-samples {flags.train_samples} is less than one global batch "
              f"({global_batch_size}): raise it")
        return None
    return iterations, ramp


def _lengths(flags: argparse.Namespace,
             global_batch_size: int) -> Tuple[Optional[int], float, Optional[int]]:
    """(decay steps, warm-up steps, WSD decay steps) in samples, as Megatron sets them."""
    if flags.train_samples is not None:
        decay = flags.lr_decay_samples if flags.lr_decay_samples is not None \
            else flags.train_samples
        warmup = flags.lr_warmup_samples
        wsd = flags.lr_wsd_decay_samples
    else:
        iters = flags.lr_decay_iters if flags.lr_decay_iters is not None else flags.train_iters
        decay = None if iters is None else iters * global_batch_size
        warmup = flags.lr_warmup_iters * global_batch_size
        wsd = None if flags.lr_wsd_decay_iters is None else \
            flags.lr_wsd_decay_iters * global_batch_size
    if flags.lr_warmup_fraction is not None and decay is not None:
        warmup = flags.lr_warmup_fraction * decay
    return decay, warmup, wsd


def _lr_flag_problems(flags: argparse.Namespace, p: "Problems") -> None:
    samples = flags.train_samples is not None
    warmup_flag = "--lr-warmup-samples" if samples else "--lr-warmup-iters"
    warmup = flags.lr_warmup_samples if samples else flags.lr_warmup_iters
    if flags.lr_warmup_fraction is not None and warmup:
        p.add(f"--lr-warmup-fraction and {warmup_flag} are exclusive: pick one")
    p.positive(flags, "lr_decay_iters", "lr_wsd_decay_iters", "lr_decay_samples",
               "lr_wsd_decay_samples")
    if flags.lr_warmup_fraction is not None and not 0.0 <= flags.lr_warmup_fraction < 1.0:
        p.add(f"--lr-warmup-fraction must be in [0, 1), got {flags.lr_warmup_fraction}")
    for flag, value in (("--lr-warmup-iters", flags.lr_warmup_iters),
                        ("--lr-warmup-samples", flags.lr_warmup_samples)):
        if value < 0:
            p.add(f"{flag} must be >= 0, got {value}")


def build_lr_schedule(flags: argparse.Namespace, global_batch_size: int,
                      p: Optional["Problems"] = None) -> Optional[LRScheduleConfig]:
    """Megatron's schedule, its steps counting samples (None if it cannot be built; without
    `p`, problems raise)."""
    from gigatron.training.validation import Problems

    own = p is None
    p = Problems() if p is None else p
    n = len(p.lines)
    _lr_flag_problems(flags, p)
    decay, warmup, wsd = _lengths(flags, global_batch_size)
    if len(p.lines) > n or flags.lr is None or decay is None or decay <= 0:
        if own:
            p.raise_if_any()
        return None
    cfg = LRScheduleConfig(max_lr=flags.lr, min_lr=flags.min_lr,
                           decay_style=flags.lr_decay_style, warmup_steps=warmup,
                           decay_steps=decay, init_lr=flags.lr_warmup_init,
                           wsd_decay_steps=wsd, wsd_decay_style=flags.lr_wsd_decay_style)
    p.run(validate_schedule, cfg, flags.train_samples is not None)
    if own:
        p.raise_if_any()
    return cfg if len(p.lines) == n else None
