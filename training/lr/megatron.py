"""Learning-rate schedules with Megatron's semantics, as pure functions of the step.

As in Megatron, a "step" counts samples: training by iterations, warm-up and decay lengths
are iterations x global batch size; by --train-samples they are samples. The schedule
advances by each applied iteration's global batch (which a batch ramp-up grows). Iteration i (1-based) uses the lr at step (i - 1) x global batch, so the first
iteration of a warm-up runs at --lr-warmup-init (0 by default).

- warm-up (step <= warmup): linear from init_lr to max_lr;
- constant: max_lr after warm-up;
- past decay_steps: min_lr;
- inverse-square-root: max_lr * sqrt(warmup / step), floored at min_lr;
- linear / cosine: from max_lr at the end of warm-up to min_lr at decay_steps;
- WSD (warmup-stable-decay): max_lr until decay_steps - wsd_decay_steps, then annealed to
  min_lr by linear | cosine | exponential | minus_sqrt.
"""
from __future__ import annotations

import math
from dataclasses import asdict, fields
from typing import Any, Dict, List, Optional, Tuple

from gigatron.training.config.run_config import LRScheduleConfig

DECAY_STYLES = ("linear", "cosine", "constant", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


def _anneal(style: str, ratio: float) -> float:
    """Coefficient in [0, 1] going from 1 at ratio 0 to 0 at ratio 1."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return 2.0 * math.pow(0.5, ratio) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown decay style {style!r}: use one of {WSD_DECAY_STYLES}")


def learning_rate(step: int, cfg: LRScheduleConfig) -> float:
    """The learning rate after `step` samples of training under schedule `cfg`."""
    if cfg.warmup_steps > 0 and step <= cfg.warmup_steps:
        return cfg.init_lr + (cfg.max_lr - cfg.init_lr) * step / cfg.warmup_steps
    if cfg.decay_style == "constant":
        return cfg.max_lr
    if step > cfg.decay_steps:
        return cfg.min_lr
    if cfg.decay_style == "inverse-square-root":
        lr = cfg.max_lr * math.sqrt(max(cfg.warmup_steps, 1)) / math.sqrt(max(step, 1))
        return max(cfg.min_lr, lr)
    delta = cfg.max_lr - cfg.min_lr
    if cfg.decay_style == "WSD":
        wsd_steps = cfg.wsd_decay_steps or 0
        anneal_start = cfg.decay_steps - wsd_steps
        if step <= anneal_start:
            return cfg.max_lr
        return cfg.min_lr + _anneal(cfg.wsd_decay_style, (step - anneal_start) / wsd_steps) * delta
    if cfg.decay_style not in ("linear", "cosine"):
        raise ValueError(f"unknown --lr-decay-style {cfg.decay_style!r}: use one of "
                         f"{', '.join(DECAY_STYLES)}")
    ratio = (step - cfg.warmup_steps) / (cfg.decay_steps - cfg.warmup_steps)
    return cfg.min_lr + _anneal(cfg.decay_style, ratio) * delta


def lr_for_iteration(iteration: int, global_batch_size: int, cfg: LRScheduleConfig) -> float:
    """The lr used by 1-based training iteration `iteration` (before it advances the schedule)."""
    return learning_rate((iteration - 1) * global_batch_size, cfg)


def _unit_flags(by_samples: bool) -> Dict[str, str]:
    """The flag names of the lengths, training by iterations or by --train-samples."""
    unit = "samples" if by_samples else "iters"
    return {"decay": f"--lr-decay-{unit}", "warmup": f"--lr-warmup-{unit}",
            "wsd": f"--lr-wsd-decay-{unit}"}


def schedule_problems(cfg: LRScheduleConfig, by_samples: bool = False,
                      names: Optional[Dict[str, str]] = None) -> List[str]:
    """Every reason Megatron would reject this schedule, one flag-naming line each
    (`by_samples`: name the --train-samples flags; `names`: the decay/warmup/wsd flags)."""
    out: List[str] = []
    names = names or _unit_flags(by_samples)
    if cfg.decay_style not in DECAY_STYLES:
        out.append(f"--lr-decay-style {cfg.decay_style!r} is not one of {', '.join(DECAY_STYLES)}")
    if cfg.max_lr < 0 or cfg.min_lr < 0:
        out.append(f"--lr ({cfg.max_lr}) and --min-lr ({cfg.min_lr}) must be >= 0")
    elif cfg.min_lr > cfg.max_lr:
        out.append(f"--min-lr {cfg.min_lr} is larger than --lr {cfg.max_lr}: lower --min-lr")
    if cfg.decay_steps <= 0:
        out.append(f"{names['decay']} must be > 0")
    elif cfg.decay_style != "constant" and cfg.warmup_steps >= cfg.decay_steps:
        out.append(f"warm-up ({cfg.warmup_steps:g} samples) is not shorter than the decay "
                   f"({cfg.decay_steps:g} samples): lower {names['warmup']}/--lr-warmup-fraction "
                   f"or raise {names['decay']}")
    if cfg.decay_style == "WSD":
        if cfg.wsd_decay_style not in WSD_DECAY_STYLES:
            out.append(f"--lr-wsd-decay-style {cfg.wsd_decay_style!r} is not one of "
                       f"{', '.join(WSD_DECAY_STYLES)}")
        if not cfg.wsd_decay_steps or cfg.wsd_decay_steps <= 0:
            out.append(f"--lr-decay-style WSD needs {names['wsd']} > 0")
        elif cfg.wsd_decay_steps > cfg.decay_steps - cfg.warmup_steps:
            out.append(f"{names['wsd']} is longer than the decay after warm-up: lower it or "
                       f"raise {names['decay']}")
    return out


def validate_schedule(cfg: LRScheduleConfig, by_samples: bool = False,
                      names: Optional[Dict[str, str]] = None) -> None:
    """Raise one ValueError listing every problem of the schedule (one line each)."""
    problems = schedule_problems(cfg, by_samples, names)
    if problems:
        raise ValueError("\n".join(problems))


# each field of LRScheduleConfig and the flag(s) that set it (steps count samples)
SCHEDULE_FLAGS = {
    "max_lr": "--lr", "min_lr": "--min-lr", "decay_style": "--lr-decay-style",
    "warmup_steps": "--lr-warmup-iters/--lr-warmup-samples/--lr-warmup-fraction/"
                    "--lr-warmup-tokens",
    "decay_steps": "--lr-decay-iters/--lr-decay-samples/--lr-decay-tokens "
                   "(--train-iters/--train-samples when unset)",
    "init_lr": "--lr-warmup-init", "wsd_decay_steps": "--lr-wsd-decay-iters/"
                                                      "--lr-wsd-decay-samples",
    "wsd_decay_style": "--lr-wsd-decay-style",
}
OVERRIDE_FLAG = "--override-opt_param-scheduler"
USE_CHECKPOINT_FLAG = "--use-checkpoint-opt_param-scheduler"


def resume_schedule(saved: Optional[Dict[str, Any]], flags: LRScheduleConfig, override: bool,
                    use_checkpoint: bool, folder: str) -> Tuple[LRScheduleConfig, Optional[str]]:
    """The schedule a resumed run follows, and a line to log when the two differ.

    Megatron's rule: the checkpoint's schedule and the flags' must agree unless
    --override-opt_param-scheduler (the flags win) or --use-checkpoint-opt_param-scheduler
    (the checkpoint wins) says which to keep; otherwise a difference is an error naming
    each differing value and both fixes. `saved` is None for a checkpoint without one.
    """
    if saved is None:
        return flags, None
    known = {f.name for f in fields(LRScheduleConfig)}
    checkpoint = LRScheduleConfig(**{k: v for k, v in saved.items() if k in known})
    ours = asdict(flags)
    differ = [f"{name} ({SCHEDULE_FLAGS.get(name, name)}) {value!r} in the checkpoint, "
              f"{ours[name]!r} from the flags"
              for name, value in asdict(checkpoint).items() if value != ours[name]]
    if not differ:
        return flags, None
    what = "; ".join(differ)
    if override:
        return flags, f"lr schedule from the flags ({OVERRIDE_FLAG}): {what}"
    if use_checkpoint:
        return checkpoint, f"lr schedule from the checkpoint ({USE_CHECKPOINT_FLAG}): {what}"
    raise ValueError(f"the lr schedule of checkpoint {folder} differs from the flags: {what} "
                     f"(steps count samples): add {USE_CHECKPOINT_FLAG} to keep the "
                     f"checkpoint's schedule, or {OVERRIDE_FLAG} to use the flags'")
