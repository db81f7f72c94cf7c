"""Samples-based training as Megatron computes it: --train-samples -> iterations, the
--rampup-batch-size ramp step by step, lr schedules of every style in samples (warm-up
fraction kept as a float), and the flags of the other mode refused. The oracles below restate
Megatron-LM's arithmetic (num_microbatches_calculator's ramp, training.py's
update_train_iters and the scheduler's step(increment)) independently of gigatron's code."""
import math
import random

import pytest

from gigatron.training.config.arguments import parse_args
from gigatron.training.run.batch_rampup import (BatchRampup, build_rampup, rampup_problems,
                                            train_iters_from_samples)
from gigatron.training.config.run_config import LRScheduleConfig
from gigatron.training.lr.megatron import learning_rate
from gigatron.training.config.validation import ConfigError

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --vocab-size 100")


def run(extra: str, world: int = 1):
    return parse_args((BASE + " " + extra).split(), world)


def megatron_batch(consumed, start, incr, ramp_samples, gbs):
    """Megatron's current global batch after `consumed` samples (the ramp calculator)."""
    if consumed > ramp_samples:
        return gbs
    per_increment = ramp_samples / ((gbs - start) // incr)
    return start + int(consumed / per_increment) * incr


def megatron_train_iters(train_samples, gbs, ramp=None):
    """Megatron's update_train_iters."""
    if ramp is None:
        return train_samples // gbs
    iterations = consumed = 0
    while consumed <= ramp[2] and consumed <= train_samples:
        consumed += megatron_batch(consumed, *ramp, gbs)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


def test_gpt3_175b_ramp_matches_megatron_at_its_boundaries():
    ramp = build_rampup([16, 16, 5859375], 1536, 16)
    per_increment = 5859375 / 95
    assert ramp.batch_size(0) == 16 and ramp.num_microbatches(0) == 1
    assert ramp.batch_size(math.floor(per_increment)) == 16
    assert ramp.batch_size(math.ceil(per_increment)) == 32
    assert ramp.batch_size(5859375) == 16 + 16 * int(5859375 / per_increment)
    assert ramp.batch_size(5859376) == 1536 and ramp.num_microbatches(5859376) == 96


@pytest.mark.parametrize("seed", range(20))
def test_ramp_equals_megatrons_calculator_step_by_step(seed):
    rng = random.Random(seed)
    unit = rng.choice([1, 2, 4, 8])  # micro batch x data-parallel size
    start = unit * rng.randint(1, 4)
    incr = unit * rng.randint(1, 3)
    gbs = start + incr * rng.randint(1, 12)
    ramp_samples = rng.randint(1, 5000)
    ramp = build_rampup([start, incr, ramp_samples], gbs, unit)
    consumed = 0
    for _ in range(2000):  # through the ramp and beyond, as the loop advances
        expected = megatron_batch(consumed, start, incr, ramp_samples, gbs)
        assert ramp.batch_size(consumed) == expected, consumed
        assert ramp.num_microbatches(consumed) == expected // unit
        consumed += expected
    train_samples = rng.randint(1, 3 * ramp_samples + 10 * gbs)
    assert train_iters_from_samples(train_samples, ramp) == \
        megatron_train_iters(train_samples, gbs, (start, incr, ramp_samples))


def test_train_samples_without_ramp_is_floor_division():
    assert train_iters_from_samples(1000, BatchRampup(64, 8)) == 15
    assert megatron_train_iters(1000, 64) == 15


@pytest.mark.parametrize("values,message", [
    ([16, 16], r"takes three numbers START INCREMENT SAMPLES, got 2"),
    ([32, 16, 100], r"START 32 is larger than --global-batch-size 16"),
    ([4, 5, 100], r"16 - START 4 = 12 is not a multiple of INCREMENT 5"),
    ([2, 2, 100], r"passes through global batches \[2, 6, 10, 14\] that are not multiples of "
                  r"--micro-batch-size x data-parallel size = 4"),
    ([0, 4, 100], r"START, INCREMENT and SAMPLES must be > 0")])
def test_bad_rampups_name_the_fix(values, message):
    import re

    problems = rampup_problems(values, 16, 4)
    assert len(problems) == 1 and re.search(message, problems[0]), problems


def test_train_samples_with_rampup_gives_megatrons_iterations_and_microbatch_counts():
    cfg = run("--train-samples 1000 --global-batch-size 32 --rampup-batch-size 8 8 200 "
              "--lr-warmup-fraction 0.013", world=2)
    assert cfg.train.train_iters == megatron_train_iters(1000, 32, (8, 8, 200))
    assert cfg.train.train_samples == 1000 and cfg.train.rampup_batch_size == [8, 8, 200]
    s = cfg.lr_schedule
    assert s.decay_steps == 1000 and s.warmup_steps == 0.013 * 1000  # not rounded


def test_lr_warmup_fraction_is_a_float_fraction_with_iterations_too():
    cfg = run("--train-iters 7 --global-batch-size 6 --lr-warmup-fraction 0.05")
    assert cfg.lr_schedule.decay_steps == 42
    assert cfg.lr_schedule.warmup_steps == pytest.approx(0.05 * 42) and \
        cfg.lr_schedule.warmup_steps != int(0.05 * 42)


def test_sample_based_lengths_come_from_the_samples_flags():
    s = run("--train-samples 640 --global-batch-size 8 --lr-decay-samples 600 "
            "--lr-warmup-samples 40 --lr-decay-style WSD --lr-wsd-decay-samples 100"
            ).lr_schedule
    assert (s.decay_steps, s.warmup_steps, s.wsd_decay_steps) == (600, 40, 100)


@pytest.mark.parametrize("extra,message", [
    ("--train-iters 4 --train-samples 64", r"--train-iters and --train-samples are exclusive"),
    ("", r"--train-iters or --train-samples is required"),
    ("--train-samples 64 --lr-decay-iters 3", r"--lr-decay-iters does not apply with "
                                              r"--train-samples .*: use --lr-decay-samples"),
    ("--train-samples 64 --lr-warmup-iters 3", r"use --lr-warmup-samples"),
    ("--train-iters 4 --lr-decay-samples 30", r"--lr-decay-samples does not apply with "
                                              r"--train-iters .*: use --lr-decay-iters"),
    ("--train-samples 64 --lr-warmup-samples 4 --lr-warmup-fraction 0.1",
     r"--lr-warmup-fraction and --lr-warmup-samples are exclusive"),
    ("--train-samples 1", r"--train-samples 1 is less than one global batch \(2\)"),
    ("--train-samples 64 --lr-decay-style WSD", r"WSD needs --lr-wsd-decay-samples > 0"),
    ("--micro-batch-size 4 --train-samples 64 --global-batch-size 8 "
     "--rampup-batch-size 2 2 10",
     r"global batches \[2, 6\] that are not multiples"),
])
def test_mode_mistakes_are_reported(extra, message):
    with pytest.raises(ConfigError, match=message):
        run(extra)


def test_rampup_with_train_iters_ramps_over_the_consumed_samples():
    """Megatron-LM's own GPT-3 175B example passes --rampup-batch-size with --train-iters
    (Megatron refuses the pair): here the batch ramps as by samples, --train-iters run."""
    from gigatron.training.config.features import flag_notes

    cfg = run("--train-iters 9 --global-batch-size 8 --rampup-batch-size 2 2 20 "
              "--lr-decay-iters 8")
    assert cfg.train.train_iters == 9 and cfg.lr_schedule.decay_steps == 64
    ramp = build_rampup(cfg.train.rampup_batch_size, 8, 2)
    assert [ramp.batch_size(c) for c in (0, 6, 7, 14, 21)] == [2, 2, 4, 6, 8]
    assert any("--rampup-batch-size with --train-iters (Megatron-LM refuses the pair)" in note
               for note in flag_notes(cfg.settings, "gloo"))


def test_mode_mistakes_are_all_reported_at_once():
    with pytest.raises(ConfigError) as err:
        run("--train-samples 64 --lr-decay-iters 3 --lr-warmup-iters 2 --lr-wsd-decay-iters 1")
    assert len(err.value.problems) == 3


# Megatron's OptimizerParamScheduler, restated: get_lr at num_steps, then step(increment)
def megatron_lr(num_steps, warmup, decay, max_lr, min_lr, init_lr, style, wsd=None,
                wsd_style="exponential"):
    if warmup > 0 and num_steps <= warmup:
        return init_lr + (max_lr - init_lr) * float(num_steps) / float(warmup)
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * max(warmup, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
    ratio = float(num_steps - warmup) / float(decay - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:  # WSD
        start = decay - wsd
        if num_steps <= start:
            coeff = 1.0
        else:
            r = float(num_steps - start) / float(wsd)
            coeff = {"linear": 1.0 - r, "cosine": 0.5 * (math.cos(math.pi * r) + 1.0),
                     "exponential": 2.0 * math.pow(0.5, r) - 1.0,
                     "minus_sqrt": 1.0 - math.sqrt(r)}[wsd_style]
    return min_lr + coeff * (max_lr - min_lr)


STYLES = [("linear", None), ("cosine", None), ("constant", None),
          ("inverse-square-root", None)] + [("WSD", w) for w in
                                            ("linear", "cosine", "exponential", "minus_sqrt")]


@pytest.mark.parametrize("style,wsd_style", STYLES)
@pytest.mark.parametrize("by", ["iters", "samples", "rampup"])
def test_every_lr_style_equals_megatron_step_by_step(style, wsd_style, by):
    gbs = 8
    if by == "iters":
        extra = ("--train-iters 60 --lr-decay-iters 50 --lr-warmup-fraction 0.07 "
                 f"--global-batch-size {gbs}")
        extra += " --lr-wsd-decay-iters 20" if style == "WSD" else ""
    else:
        extra = (f"--train-samples 500 --lr-decay-samples 420 --lr-warmup-samples 37 "
                 f"--global-batch-size {gbs}")
        extra += " --lr-wsd-decay-samples 150" if style == "WSD" else ""
        extra += " --rampup-batch-size 2 2 120" if by == "rampup" else ""
    extra += f" --lr-decay-style {style} --min-lr 1e-5 --lr-warmup-init 1e-6"
    extra += f" --lr-wsd-decay-style {wsd_style}" if wsd_style else ""
    cfg = run(extra)
    s = cfg.lr_schedule
    ramp = build_rampup(cfg.train.rampup_batch_size, gbs, 2)
    consumed = 0  # Megatron's num_steps: advanced by each iteration's batch
    for _ in range(cfg.train.train_iters):
        expected = megatron_lr(consumed, s.warmup_steps, s.decay_steps, 1e-3, 1e-5, 1e-6,
                               style, s.wsd_decay_steps, wsd_style or "exponential")
        assert learning_rate(consumed, s) == pytest.approx(expected, rel=1e-12, abs=1e-18)
        consumed += ramp.batch_size(consumed)
    if by == "iters":
        assert (s.decay_steps, s.warmup_steps) == (400, 0.07 * 400)
        assert s.wsd_decay_steps == (160 if style == "WSD" else None)


def test_learning_rate_accepts_a_float_warmup():
    cfg = LRScheduleConfig(max_lr=1.0, warmup_steps=2.5, decay_steps=10)
    assert learning_rate(2, cfg) == pytest.approx(2 / 2.5)
    assert learning_rate(3, cfg) == pytest.approx(1 - 0.5 / 7.5)
