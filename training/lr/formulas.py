"""DeepSpeed's learning-rate schedules as pure functions of the step (see training/lr/deepspeed.py).

`step` is DeepSpeed's `last_batch_iteration`: -1 before the first `step()`, then 0, 1, ...
W = max(2, warmup_num_steps); T = total_num_steps. Formulas as DeepSpeed's
`deepspeed/runtime/lr_schedules.py` (deepspeedai/DeepSpeed edaa7221, version 0.19.6).
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple

from gigatron.training.config.spelling import nearest

WARMUP_TYPES = ("log", "linear")


def warmup_gamma(step: int, warmup_num_steps: int = 1000, warmup_type: str = "log") -> float:
    """Fraction of the warm-up done at `step`: 0 at step 0, 1 from step max(2, W) on."""
    check_warmup(warmup_num_steps, warmup_type)
    num_steps = max(2, warmup_num_steps)
    if step >= num_steps:
        return 1.0
    if warmup_type == "log":
        return (1.0 / math.log(num_steps)) * math.log(step + 1)  # DeepSpeed's rounding
    return step / num_steps


def warmup_lr(step: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
              warmup_num_steps: int = 1000, warmup_type: str = "log") -> float:
    """WarmupLR's lr at `step`: warm up from warmup_min_lr, then stay at warmup_max_lr."""
    if step < 0:
        return warmup_min_lr
    gamma = warmup_gamma(step, warmup_num_steps, warmup_type)
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_decay_lr(step: int, total_num_steps: int, warmup_min_lr: float = 0.0,
                    warmup_max_lr: float = 0.001, warmup_num_steps: int = 1000,
                    warmup_type: str = "log") -> float:
    """WarmupDecayLR's lr at `step`: warm up, then decay linearly to warmup_min_lr at T."""
    num_steps = max(2, warmup_num_steps)
    if step < num_steps:
        return warmup_lr(step, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)
    gamma = max(0.0, float(total_num_steps - step) / float(max(1.0, total_num_steps - num_steps)))
    return warmup_min_lr + (warmup_max_lr - warmup_min_lr) * gamma


def warmup_cosine_ratio(step: int, total_num_steps: int, warmup_min_ratio: float = 0.0,
                        warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                        warmup_type: str = "log") -> float:
    """WarmupCosineLR's multiplier of the base lr at `step`."""
    if step < 0:
        return 0.0
    num_steps = max(2, warmup_num_steps)
    if step < num_steps:
        gamma = warmup_gamma(step, warmup_num_steps, warmup_type)
        return warmup_min_ratio + gamma * (1.0 - warmup_min_ratio)
    progress = min(1.0, (step - num_steps + 1) / max(1, total_num_steps - num_steps))
    cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
    return max(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * cosine)


def warmup_cosine_lr(step: int, base_lr: float, total_num_steps: int,
                     warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                     cos_min_ratio: float = 0.0001, warmup_type: str = "log") -> float:
    """WarmupCosineLR's lr at `step` for a group whose lr was `base_lr` at construction."""
    return base_lr * warmup_cosine_ratio(step, total_num_steps, warmup_min_ratio,
                                         warmup_num_steps, cos_min_ratio, warmup_type)


def lr_range_test_lr(step: int, lr_range_test_min_lr: float = 1e-3,
                     lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                     lr_range_test_staircase: bool = False) -> float:
    """LRRangeTest's lr at `step`: grows linearly (or by stairs) from lr_range_test_min_lr."""
    check_positive_int("lr_range_test_step_size", lr_range_test_step_size)
    interval = float(step + 1) / lr_range_test_step_size
    if lr_range_test_staircase:
        interval = math.floor(interval)
    return lr_range_test_min_lr * (1 + lr_range_test_step_rate * interval)


def one_cycle_scale(step: int, cycle_first_step_size: int = 2000,
                    cycle_second_step_size: Optional[int] = None,
                    cycle_first_stair_count: int = 0,
                    cycle_second_stair_count: Optional[int] = None) -> float:
    """How far up the cycle `step` is: 0 at its ends, 1 at the peak after the first half."""
    first, second = cycle_halves(cycle_first_step_size, cycle_second_step_size)
    total = first + second
    ratio = first / total
    batch = step + 1
    x = 1.0 + batch / total - math.floor(1 + batch / total)
    rising = x <= ratio
    scale = x / ratio if rising else (x - 1) / (ratio - 1)
    second_stairs = cycle_first_stair_count if cycle_second_stair_count is None \
        else cycle_second_stair_count
    stairs = cycle_first_stair_count if rising else second_stairs
    if stairs > 0:
        # from the integer offset, not the float scale: the peak must not fall one stair short
        offset = batch % total
        position = offset * stairs / first if offset <= first \
            else (total - offset) * stairs / second
        scale = math.floor(position) / stairs
    return scale


def one_cycle_lr(step: int, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None,
                 decay_step_size: int = 0) -> float:
    """OneCycle's lr at `step`: up and down the cycle, then cycle_min_lr decayed."""
    first, second = cycle_halves(cycle_first_step_size, cycle_second_step_size)
    if step < first + second:
        scale = one_cycle_scale(step, cycle_first_step_size, cycle_second_step_size,
                                cycle_first_stair_count, cycle_second_stair_count)
        return cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale
    factor = decay_factor(step - (first + second) + 1, decay_lr_rate, decay_step_size)
    return cycle_min_lr / factor


def one_cycle_momentum(step: int, cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
                       decay_mom_rate: float = 0.0, cycle_first_step_size: int = 2000,
                       cycle_second_step_size: Optional[int] = None,
                       cycle_first_stair_count: int = 0,
                       cycle_second_stair_count: Optional[int] = None,
                       decay_step_size: int = 0) -> float:
    """OneCycle's momentum (beta1) at `step`: mirrors the lr, then cycle_max_mom grown."""
    first, second = cycle_halves(cycle_first_step_size, cycle_second_step_size)
    if step < first + second:
        scale = one_cycle_scale(step, cycle_first_step_size, cycle_second_step_size,
                                cycle_first_stair_count, cycle_second_stair_count)
        return cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale
    factor = decay_factor(step - (first + second) + 1, decay_mom_rate, decay_step_size)
    return cycle_max_mom * factor


def decay_factor(batches_after_cycle: float, rate: float, decay_step_size: float) -> float:
    """OneCycle's post-cycle divisor (lr) or multiplier (momentum); 1 when decay is off."""
    if decay_step_size == 0 or rate == 0:
        return 1.0
    return 1 + rate * (batches_after_cycle / decay_step_size)


def cycle_halves(first: int, second: Optional[int]) -> Tuple[float, float]:
    """The two half-cycle lengths as floats, second defaulting to first; checked."""
    first_f = float(first)
    second_f = first_f if second is None else float(second)
    if first_f <= 0:
        raise ValueError(f"cycle_first_step_size must be positive, got {first}")
    if second_f < 0:
        raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
    return first_f, second_f


def check_positive_int(name: str, value: Any) -> None:
    """DeepSpeed's check on step counts: a positive int (1000.0 from JSON is refused too)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_warmup(warmup_num_steps: Any, warmup_type: str) -> None:
    """Refuse a warm-up length or type DeepSpeed would refuse or silently replace."""
    check_positive_int("warmup_num_steps", warmup_num_steps)
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(unknown_name_message("warmup_type", warmup_type, WARMUP_TYPES))


def unknown_name_message(what: str, name: str, valid: Sequence[str]) -> str:
    """'unknown X 'y': valid names are ...; did you mean 'z'?' for a misspelt name."""
    close = nearest(str(name), valid, cutoff=0.0)
    hint = f"; did you mean {close!r}?" if close else ""
    return f"unknown {what} {name!r}: valid names are {', '.join(valid)}{hint}"
