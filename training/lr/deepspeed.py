"""DeepSpeed's learning-rate schedulers: the `"scheduler"` section of a DeepSpeed config.

Same class names, parameter names, defaults and formulas as DeepSpeed's
`deepspeed/runtime/lr_schedules.py`, read at deepspeedai/DeepSpeed edaa7221 (version 0.19.6,
2026-08-22; the file last changed in 8cae9d28, #8201). Written anew from those facts.

`step` below is DeepSpeed's `last_batch_iteration`: -1 before the first `step()`, then 0, 1, ...
Each schedule is also a pure function of the step (`warmup_lr`, `one_cycle_lr`, ...).
W = max(2, warmup_num_steps); T = total_num_steps.

Where gigatron differs on purpose: an unknown warmup_type is a ValueError (DeepSpeed warns and
uses 'log'); OneCycle's momentum sets betas[0] and keeps the group's beta2 (DeepSpeed writes
(momentum, 0.99)) and also cycles SGD's `momentum` (DeepSpeed only cycles betas); get_mom()
returns floats; `get_last_lr()` works from construction on; every `step` takes
`last_batch_iteration` (DeepSpeed's LRRangeTest and OneCycle name it `batch_iteration`).
"""
from __future__ import annotations

import inspect
import warnings
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from gigatron.training.config.deepspeed.engine_config import SchedulerSpec
from gigatron.training.lr.formulas import (check_positive_int, check_warmup, cycle_halves,
                                         lr_range_test_lr, one_cycle_lr, one_cycle_momentum,
                                         unknown_name_message, warmup_cosine_ratio,
                                         warmup_decay_lr, warmup_lr)

PerGroup = Union[float, Sequence[float]]


def _warn_if_shorter_than_warmup(total_num_steps: int, warmup_num_steps: int) -> None:
    """DeepSpeed's warning: the decay never starts when the run ends inside the warm-up."""
    if total_num_steps < warmup_num_steps:
        warnings.warn(f"total_num_steps {total_num_steps} is less than warmup_num_steps "
                      f"{warmup_num_steps}")


# ---- schedulers over an optimizer's param groups --------------------------------------
def _param_groups_owner(optimizer: Any) -> Any:
    """The object holding `param_groups`: the optimizer, or the torch one a wrapper holds."""
    if hasattr(optimizer, "param_groups"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None and hasattr(inner, "param_groups"):
        return inner
    raise TypeError(f"{type(optimizer).__name__} has no param_groups (nor .optimizer with them)")


def _per_group(value: Any, groups: List[Dict[str, Any]], name: str) -> List[float]:
    """A scalar broadcast to every param group, or a list with one value per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ValueError(f"expected {len(groups)} values for {name} (one per param "
                             f"group), got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * len(groups)


def _lr_value(lr: Any) -> float:
    """A group's lr as a Python float (it may be a one-element tensor)."""
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


class _Scheduler:
    """What every DeepSpeed scheduler shares: the step counter and writing lrs to groups."""

    def __init__(self, optimizer: Any, last_batch_iteration: int) -> None:
        self.optimizer = _param_groups_owner(optimizer)
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: Optional[List[Any]] = None

    def get_lr(self) -> List[float]:
        """The lr of each param group at the current step."""
        raise NotImplementedError

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance one batch (or jump to `last_batch_iteration`) and set every group's lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write_lrs(self.get_lr())

    def get_last_lr(self) -> List[Any]:
        """The lrs last written to the param groups."""
        if self._last_lr is None:
            raise RuntimeError("need to call step() first (the scheduler was built to resume)")
        return self._last_lr

    def state_dict(self) -> Dict[str, int]:
        """What resuming needs: DeepSpeed's {'last_batch_iteration': n}."""
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Dict[str, int]) -> None:
        """Resume at a saved step; the next step() writes the lr of the batch after it."""
        self.last_batch_iteration = sd["last_batch_iteration"]

    def _write_lrs(self, lrs: List[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # tensor lrs stay the same tensor (captured graphs)
            else:
                group["lr"] = lr
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]


class WarmupLR(_Scheduler):
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(self, optimizer: Any, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: Optional[PerGroup] = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        if warmup_max_lr is None:
            warmup_max_lr = [_lr_value(g["lr"]) for g in groups]
        self.min_lrs = _per_group(warmup_min_lr, groups, "warmup_min_lr")
        self.max_lrs = _per_group(warmup_max_lr, groups, "warmup_max_lr")
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        if last_batch_iteration == -1:
            self._write_lrs(self.get_lr())

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step."""
        return [warmup_lr(self.last_batch_iteration, lo, hi, self.warmup_num_steps,
                          self.warmup_type) for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay back to warmup_min_lr at total_num_steps."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: PerGroup = 0.0,
                 warmup_max_lr: PerGroup = 0.001, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps,
                         warmup_type, last_batch_iteration)
        _warn_if_shorter_than_warmup(total_num_steps, self.warmup_num_steps)

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step."""
        return [warmup_decay_lr(self.last_batch_iteration, self.total_num_steps, lo, hi,
                                self.warmup_num_steps, self.warmup_type)
                for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupCosineLR(_Scheduler):
    """Scale each group's own lr: warm up from warmup_min_ratio, cosine down to cos_min_ratio."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = warmup_type
        _warn_if_shorter_than_warmup(total_num_steps, self.warmup_num_steps)
        self.org_lrs = [_lr_value(g["lr"]) for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._write_lrs(self.get_lr())

    def get_lr_ratio(self) -> float:
        """The multiplier of every group's base lr at the current step."""
        return warmup_cosine_ratio(self.last_batch_iteration, self.total_num_steps,
                                   self.warmup_min_ratio, self.warmup_num_steps,
                                   self.cos_min_ratio, self.warmup_type)

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step."""
        ratio = self.get_lr_ratio()
        return [base_lr * ratio for base_lr in self.org_lrs]


class OneCycle(_Scheduler):
    """1Cycle: lr up then down (momentum the other way), then an optional slow decay."""

    def __init__(self, optimizer: Any, cycle_min_lr: PerGroup, cycle_max_lr: PerGroup,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
                 cycle_second_step_size: Optional[int] = None, cycle_first_stair_count: int = 0,
                 cycle_second_stair_count: Optional[int] = None, decay_step_size: int = 0,
                 cycle_momentum: bool = True, cycle_min_mom: PerGroup = 0.8,
                 cycle_max_mom: PerGroup = 0.9, decay_mom_rate: float = 0.0,
                 last_batch_iteration: int = -1) -> None:
        cycle_halves(cycle_first_step_size, cycle_second_step_size)
        super().__init__(optimizer, last_batch_iteration)
        groups = self.optimizer.param_groups
        self.min_lrs = _per_group(cycle_min_lr, groups, "cycle_min_lr")
        self.max_lrs = _per_group(cycle_max_lr, groups, "cycle_max_lr")
        self.min_moms = _per_group(cycle_min_mom, groups, "cycle_min_mom")
        self.max_moms = _per_group(cycle_max_mom, groups, "cycle_max_mom")
        self.decay_lr_rate = decay_lr_rate
        self.decay_mom_rate = decay_mom_rate
        self.cycle: Dict[str, Any] = dict(cycle_first_step_size=cycle_first_step_size,
                          cycle_second_step_size=cycle_second_step_size,
                          cycle_first_stair_count=cycle_first_stair_count,
                          cycle_second_stair_count=cycle_second_stair_count,
                          decay_step_size=decay_step_size)
        self.cycle_momentum = cycle_momentum and _has_momentum(self.optimizer)
        if last_batch_iteration == -1:
            self._write_lrs(list(self.min_lrs))
            if self.cycle_momentum:
                _write_momentum(groups, self.min_moms)

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step."""
        return [one_cycle_lr(self.last_batch_iteration, lo, hi, self.decay_lr_rate, **self.cycle)
                for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def get_mom(self) -> Optional[List[float]]:
        """Each group's momentum (beta1) at the current step; None when not cycled."""
        if not self.cycle_momentum:
            return None
        return [one_cycle_momentum(self.last_batch_iteration, lo, hi, self.decay_mom_rate,
                                   **self.cycle)
                for lo, hi in zip(self.min_moms, self.max_moms)]

    def step(self, last_batch_iteration: Optional[int] = None) -> None:
        """Advance one batch (or jump to `last_batch_iteration`): set lrs and momentums."""
        super().step(last_batch_iteration)
        momentums = self.get_mom()
        if momentums is not None:
            _write_momentum(self.optimizer.param_groups, momentums)


def _has_momentum(optimizer: Any) -> bool:
    """Whether any group has betas (Adam-style) or momentum (SGD-style) to cycle; warn if not."""
    if any("betas" in g or "momentum" in g for g in optimizer.param_groups):
        return True
    warnings.warn(f"cycle_momentum is disabled: {type(optimizer).__name__} has neither betas "
                  "nor momentum in its param groups")
    return False


def _write_momentum(groups: List[Dict[str, Any]], momentums: List[float]) -> None:
    """Set beta1 (keeping beta2) of Adam-style groups, `momentum` of SGD-style ones."""
    for group, momentum in zip(groups, momentums):
        if "betas" in group:
            group["betas"] = (momentum, *tuple(group["betas"])[1:])
        elif "momentum" in group:
            group["momentum"] = momentum


class LRRangeTest(_Scheduler):
    """LR range test: raise the lr steadily from lr_range_test_min_lr to find where it diverges."""

    def __init__(self, optimizer: Any, lr_range_test_min_lr: PerGroup = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        check_positive_int("lr_range_test_step_size", lr_range_test_step_size)
        super().__init__(optimizer, last_batch_iteration)
        self.min_lr = _per_group(lr_range_test_min_lr, self.optimizer.param_groups,
                                 "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            self._write_lrs(list(self.min_lr))

    def get_lr(self) -> List[float]:
        """Each group's lr at the current step."""
        return [lr_range_test_lr(self.last_batch_iteration, lo, self.step_size, self.step_rate,
                                 self.staircase) for lo in self.min_lr]


# ---- from the config -----------------------------------------------------------------
SCHEDULERS = {cls.__name__: cls for cls in
              (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def scheduler_params(scheduler_type: str) -> Dict[str, Any]:
    """The params a scheduler type takes, with DeepSpeed's defaults (REQUIRED when none)."""
    if scheduler_type not in SCHEDULERS:
        raise ValueError(unknown_name_message("scheduler type", scheduler_type, list(SCHEDULERS)))
    signature = inspect.signature(SCHEDULERS[scheduler_type].__init__)
    return {name: "REQUIRED" if p.default is inspect.Parameter.empty else p.default
            for name, p in signature.parameters.items() if name not in ("self", "optimizer")}


def build_scheduler(spec: SchedulerSpec, optimizer: Any) -> _Scheduler:
    """The scheduler a DeepSpeed config's `"scheduler"` section asks for, over `optimizer`."""
    allowed = scheduler_params(spec.type)
    for name in spec.params:
        if name not in allowed:
            raise ValueError(unknown_name_message(f"{spec.type} param", name, list(allowed)))
    missing = [n for n, d in allowed.items() if d == "REQUIRED" and n not in spec.params]
    if missing:
        raise ValueError(f"scheduler {spec.type} needs params: {', '.join(missing)}")
    return SCHEDULERS[spec.type](optimizer, **spec.params)
