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
the banner says so (`features.flag_notes`).

Token-based lengths (Megatron-DeepSpeed's --train-tokens, --lr-decay-tokens,
--lr-warmup-tokens) are samples x --seq-length: a token length is turned into samples
(tokens / --seq-length, not rounded), so the schedule is the same pure function of consumed
samples. --train-tokens stops training once that many tokens are consumed, or at
--train-iters/--train-samples if sooner. --lr-decay-tokens overrides the iteration/sample
decay and --lr-warmup-tokens the warm-up, as in Megatron-DeepSpeed. One difference, by
design: Megatron-DeepSpeed's scheduler reads the token count before the finished iteration
is added, so its token-based lr lags its sample count by one iteration; here iteration i uses
the tokens consumed before it, like every other length.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from gigatron.training.run.batch_rampup import (BatchRampup, build_rampup,
                                            iterations_to_consume, rampup_problems,
                                            train_iters_from_samples)
from gigatron.training.config.run_config import LRScheduleConfig
from gigatron.training.lr.megatron import validate_schedule

if TYPE_CHECKING:
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

# flag dests that belong to one mode, each with the flag of the other mode to use instead
_ITERATION_ONLY = (("lr_decay_iters", "--lr-decay-samples"),
                   ("lr_warmup_iters", "--lr-warmup-samples"),
                   ("lr_wsd_decay_iters", "--lr-wsd-decay-samples"))
_SAMPLE_ONLY = (("lr_decay_samples", "--lr-decay-iters"),
                ("lr_warmup_samples", "--lr-warmup-iters"),
                ("lr_wsd_decay_samples", "--lr-wsd-decay-iters"))


def _given(s: "Settings", dest: str) -> bool:
    value = s.value(dest)
    return value not in (None, 0)


def _mode_problems(s: "Settings") -> List[str]:
    """Flags of the other mode (Megatron asserts each of them)."""
    from gigatron.training.config.table import flag_name

    if s.train.train_iters is not None and s.train.train_samples is not None:
        return ["--train-iters and --train-samples are exclusive: train by iterations or by "
                "samples"]
    if s.train.train_iters is None and s.train.train_samples is None:
        return ["--train-iters or --train-samples is required"]
    samples = s.train.train_samples is not None
    wrong = _ITERATION_ONLY if samples else _SAMPLE_ONLY
    out = []
    for dest, instead in wrong:  # (the ramp is accepted with --train-iters too: see above)
        if _given(s, dest):
            mode = "--train-samples (sample-based)" if samples else \
                "--train-iters (iteration-based)"
            out.append(f"{flag_name(dest)} does not apply with {mode}: use {instead}")
    return out


def training_length(s: "Settings", micro_batch_times_dp: Optional[int],
                    global_batch_size: Optional[int], p: "Problems",
                    seq_length: Optional[int] = None) -> Optional[Tuple[int, BatchRampup]]:
    """(iterations to train, the batch ramp); None with the problems recorded (the batch
    sizes None: they are wrong, only the problems that do not depend on them are).
    `seq_length`: tokens per sample, for --train-tokens (default --seq-length)."""
    n, t = len(p.lines), s.train
    p.positive(s, "train_iters", "train_samples", "train_tokens")
    p.lines += _mode_problems(s)
    values = t.rampup_batch_size
    if micro_batch_times_dp is None or global_batch_size is None:
        return None
    if values:
        p.lines += rampup_problems(values, global_batch_size, micro_batch_times_dp)
    if len(p.lines) > n:
        return None
    ramp = build_rampup(values, global_batch_size, micro_batch_times_dp)
    if t.train_iters is not None:
        iterations = t.train_iters
    else:
        assert t.train_samples is not None  # _mode_problems: one of the two is given
        iterations = train_iters_from_samples(t.train_samples, ramp)
        if iterations < 1:
            p.add(f"--train-samples {t.train_samples} is less than one global batch "
                  f"({global_batch_size}): raise it")
            return None
    if t.train_tokens is not None:
        seq = _tokens_per_sample(s, seq_length, "--train-tokens", p)
        if seq is None:
            return None
        iterations = min(iterations, iterations_to_consume(-(-t.train_tokens // seq), ramp))
    return iterations, ramp


def _tokens_per_sample(s: "Settings", seq_length: Optional[int], flag: str,
                       p: "Problems") -> Optional[int]:
    seq = seq_length if seq_length is not None else s.model.seq_length
    if not seq or seq <= 0:
        p.add(f"{flag} needs the tokens per sample: give --seq-length (or --model)")
        return None
    return int(seq)


def _lengths(s: "Settings", global_batch_size: int, seq_length: Optional[int]
             ) -> Tuple[Optional[float], float, Optional[int]]:
    """(decay steps, warm-up steps, WSD decay steps) in samples, as Megatron sets them (token
    lengths, Megatron-DeepSpeed's, as tokens / seq_length samples)."""
    o, t = s.optimizer, s.train
    decay: Optional[float]
    warmup: float
    if t.train_samples is not None:
        decay = o.lr_decay_samples if o.lr_decay_samples is not None else t.train_samples
        warmup = o.lr_warmup_samples
        wsd = o.lr_wsd_decay_samples
    else:
        iters = o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters
        decay = None if iters is None else iters * global_batch_size
        warmup = o.lr_warmup_iters * global_batch_size
        wsd = None if o.lr_wsd_decay_iters is None else o.lr_wsd_decay_iters * global_batch_size
    if o.lr_warmup_fraction is not None and decay is not None:
        warmup = o.lr_warmup_fraction * decay
    if seq_length:
        if o.lr_decay_tokens is not None:
            decay = o.lr_decay_tokens / seq_length
        if o.lr_warmup_tokens is not None:
            warmup = o.lr_warmup_tokens / seq_length
    return decay, warmup, wsd


def _lr_flag_problems(s: "Settings", p: "Problems") -> None:
    o, samples = s.optimizer, s.train.train_samples is not None
    warmup_flag = "--lr-warmup-samples" if samples else "--lr-warmup-iters"
    warmup = o.lr_warmup_samples if samples else o.lr_warmup_iters
    if o.lr_warmup_fraction is not None and warmup:
        p.add(f"--lr-warmup-fraction and {warmup_flag} are exclusive: pick one")
    p.positive(s, "lr_decay_iters", "lr_wsd_decay_iters", "lr_decay_samples",
               "lr_wsd_decay_samples", "lr_decay_tokens")
    if o.lr_warmup_tokens is not None and o.lr_warmup_tokens < 0:
        p.add(f"--lr-warmup-tokens must be >= 0, got {o.lr_warmup_tokens}")
    if o.lr_warmup_fraction is not None and not 0.0 <= o.lr_warmup_fraction < 1.0:
        p.add(f"--lr-warmup-fraction must be in [0, 1), got {o.lr_warmup_fraction}")
    for flag, value in (("--lr-warmup-iters", o.lr_warmup_iters),
                        ("--lr-warmup-samples", o.lr_warmup_samples)):
        if value < 0:
            p.add(f"{flag} must be >= 0, got {value}")


def build_lr_schedule(s: "Settings", global_batch_size: Optional[int], p: "Problems",
                      seq_length: Optional[int] = None) -> Optional[LRScheduleConfig]:
    """Megatron's schedule, its steps counting samples (None, with the problems recorded, if
    it cannot be built; `global_batch_size` None: only the problems that do not depend on
    it). `seq_length`: tokens per sample, for the token lengths (default --seq-length)."""
    n, o = len(p.lines), s.optimizer
    _lr_flag_problems(s, p)
    if global_batch_size is None:
        return None
    seq = None
    for dest in ("lr_decay_tokens", "lr_warmup_tokens"):
        if s.value(dest) is not None:
            seq = _tokens_per_sample(s, seq_length, "--" + dest.replace("_", "-"), p)
            break
    decay, warmup, wsd = _lengths(s, global_batch_size, seq)
    if len(p.lines) > n or o.lr is None or decay is None or decay <= 0:
        return None
    cfg = LRScheduleConfig(max_lr=o.lr, min_lr=o.min_lr, decay_style=o.lr_decay_style,
                           warmup_steps=warmup, decay_steps=decay, init_lr=o.lr_warmup_init,
                           wsd_decay_steps=wsd, wsd_decay_style=o.lr_wsd_decay_style)
    p.run(validate_schedule, cfg, s.train.train_samples is not None,
          _token_flag_names(s) if seq else None)
    return cfg if len(p.lines) == n else None


def _token_flag_names(s: "Settings") -> Dict[str, str]:
    """The flags that set the decay and warm-up lengths, where a token length overrides."""
    unit = "samples" if s.train.train_samples is not None else "iters"
    return {"decay": "--lr-decay-tokens" if s.optimizer.lr_decay_tokens is not None
            else f"--lr-decay-{unit}",
            "warmup": "--lr-warmup-tokens" if s.optimizer.lr_warmup_tokens is not None
            else f"--lr-warmup-{unit}",
            "wsd": f"--lr-wsd-decay-{unit}"}
