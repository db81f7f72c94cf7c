"""Megatron-DeepSpeed's token-based lengths: --train-tokens, --lr-decay-tokens and
--lr-warmup-tokens. The oracle restates Megatron-DeepSpeed's OptimizerParamScheduler.get_lr
(megatron/optimizer_param_scheduler.py) as a function of the consumed tokens, independently of
gigatron's schedule code; gigatron's iteration i uses the tokens consumed before it."""
import math

import pytest

from gigatron.training.config.arguments import parse_args
from gigatron.training.lr.megatron import lr_for_iteration
from gigatron.training.config.validation import ConfigError

SEQ = 16
BASE = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length {SEQ} "
        "--micro-batch-size 2 --lr 1e-3 --min-lr 1e-5 --mock-data --vocab-size 100")


def run(extra: str, world: int = 1):
    return parse_args((BASE + " " + extra).split(), world)


def mds_lr(num_steps, num_tokens, max_lr, min_lr, style, warmup_steps, decay_steps,
           warmup_tokens, decay_tokens):
    """Megatron-DeepSpeed's get_lr (steps count samples)."""
    if warmup_tokens is None:
        if warmup_steps > 0 and num_steps <= warmup_steps:
            return max_lr * num_steps / warmup_steps
        if decay_tokens is not None and warmup_steps > 0:  # step warm-up + token decay:
            warmup_tokens = warmup_steps * SEQ  # the tokens consumed when warm-up ended
    elif warmup_tokens > 0 and num_tokens <= warmup_tokens:
        return max_lr * num_tokens / warmup_tokens
    if style == "constant":
        return max_lr
    if (num_steps > decay_steps) if decay_tokens is None else (num_tokens > decay_tokens):
        return min_lr
    if style == "inverse-square-root":
        if warmup_tokens is None:
            return max(min_lr, max_lr * max(warmup_steps, 1) ** 0.5 / max(num_steps, 1) ** 0.5)
        return max(min_lr, max_lr * max(warmup_tokens, 1) ** 0.5 / max(num_tokens, 1) ** 0.5)
    if decay_tokens is None:
        ratio = (num_steps - warmup_steps) / (decay_steps - warmup_steps)
    else:
        start = warmup_tokens or 0  # (Megatron-DeepSpeed fails on None: no warm-up at all)
        ratio = (num_tokens - start) / (decay_tokens - start)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "constant"])
@pytest.mark.parametrize("warmup", ["tokens", "samples", "none"])
def test_token_schedules_equal_megatron_deepspeed_step_by_step(style, warmup):
    gbs = 8
    flags = f"--train-samples 4000 --global-batch-size {gbs} --lr-decay-style {style} " \
            f"--lr-decay-tokens {3000 * SEQ + 5}"
    warmup_tokens = None
    warmup_samples = 0
    if warmup == "tokens":
        warmup_tokens = 40 * SEQ + 3
        flags += f" --lr-warmup-tokens {warmup_tokens}"
    elif warmup == "samples":
        warmup_samples = 48
        flags += f" --lr-warmup-samples {warmup_samples}"
    cfg = run(flags).lr_schedule
    worst = 0.0
    for it in range(1, 4000 // gbs + 1):
        samples = (it - 1) * gbs
        want = mds_lr(samples, samples * SEQ, 1e-3, 1e-5, style, warmup_samples, 4000,
                      warmup_tokens, 3000 * SEQ + 5)
        worst = max(worst, abs(lr_for_iteration(it, gbs, cfg) - want))
    assert worst < 1e-15, worst


def test_decay_tokens_override_the_iteration_decay_too():
    cfg = run("--train-iters 100 --global-batch-size 4 --lr-decay-iters 50 "
              f"--lr-decay-tokens {200 * SEQ}").lr_schedule
    assert cfg.decay_steps == 200  # samples: the token length wins over 50 x 4


@pytest.mark.parametrize("extra, iterations", [
    ("--train-samples 1000 --global-batch-size 8", 125),
    (f"--train-samples 1000 --global-batch-size 8 --train-tokens {400 * SEQ}", 50),
    (f"--train-samples 1000 --global-batch-size 8 --train-tokens {401 * SEQ}", 51),
    (f"--train-samples 1000 --global-batch-size 8 --train-tokens {400 * SEQ + 1}", 51),
    (f"--train-iters 20 --global-batch-size 8 --train-tokens {400 * SEQ}", 20),
    # a ramp 2 -> 8 by 2 over 24 samples: batches 2,2,2,2,4,4,4,6,... until 24 consumed
    (f"--train-samples 1000 --global-batch-size 8 --rampup-batch-size 2 2 24 "
     f"--train-tokens {30 * SEQ}", None),
])
def test_train_tokens_stops_at_the_first_iteration_that_reaches_them(extra, iterations):
    cfg = run(extra)
    if iterations is None:  # count through the ramp as Megatron-DeepSpeed's loop does
        from gigatron.training.run.batch_rampup import build_rampup
        ramp = build_rampup([2, 2, 24], 8, 2)
        consumed = iterations = 0
        while consumed * SEQ < 30 * SEQ:
            consumed += ramp.batch_size(consumed)
            iterations += 1
    assert cfg.train.train_iters == iterations


@pytest.mark.parametrize("extra, message", [
    ("--train-iters 10 --train-tokens 0", "--train-tokens must be > 0"),
    ("--train-iters 10 --lr-decay-tokens -5", "--lr-decay-tokens must be > 0"),
    ("--train-iters 10 --lr-warmup-tokens -1", "--lr-warmup-tokens must be >= 0"),
    (f"--train-iters 10 --lr-decay-tokens {10 * SEQ} --lr-warmup-tokens {20 * SEQ}",
     "lower --lr-warmup-tokens"),
])
def test_bad_token_lengths_name_the_flag(extra, message):
    with pytest.raises(ConfigError, match=message):
        run(extra)
