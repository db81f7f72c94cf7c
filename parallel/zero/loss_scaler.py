"""Loss scaling for fp16 training: a static scale, or a dynamic one with Megatron's or
DeepSpeed's rule.

Both rules start at 2**initial_scale_power. On an overflow the step is skipped; if
hysteresis is exhausted (its counter is 1) the scale is divided by 2 (never below
min_loss_scale), otherwise the counter is decremented and the scale kept. They differ in
when the scale grows back, for the same window W:

- "megatron" (Megatron-Core's DynamicGradScaler, pretrain_gpt.py's --loss-scale-window):
  the scale doubles after every W clean steps since the last overflow: at the W-th clean
  step, then the 2W-th, ...
- "deepspeed" (DeepSpeed's DynamicLossScaler.update_scale, the fp16.loss_scale_window key
  under gigatron.initialize): the first clean step after an overflow (or the very first
  step) does not count, so the scale doubles at the (W+1)-th clean step, then every W; and
  an overflow whose back-off would go below min_loss_scale (the scale already at it) stops
  the run, as DeepSpeed's "Current loss scale already at minimum".

Growth refills the hysteresis counter; with consecutive_hysteresis (DeepSpeed only) every
clean step refills it.
"""
from __future__ import annotations

from typing import Any, Dict

RULES = ("megatron", "deepspeed")


class LossScaleAtMinimumError(FloatingPointError):
    """DeepSpeed's rule: an fp16 overflow with the loss scale already at min_loss_scale."""


class LossScaler:
    """A static loss scale (1.0 for bf16/fp32; `loss_scale` > 0 for static fp16)."""

    dynamic = False
    # the last update was an overflow that a dynamic scale could not answer by backing off,
    # being at its floor (Megatron's rule keeps going; the training loop decides)
    at_minimum = False

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    def update(self, overflow: bool) -> None:
        """Static scales never change."""

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler(LossScaler):
    """Dynamic loss scale: backs off on overflow (after `hysteresis` of them), grows after
    `loss_scale_window` clean steps, counted by `rule` ("megatron" or "deepspeed")."""

    dynamic = True

    def __init__(self, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0,
                 consecutive_hysteresis: bool = False, scale_factor: float = 2.0,
                 rule: str = "megatron") -> None:
        if rule not in RULES:
            raise ValueError(f"loss scale rule must be one of {RULES}, got {rule!r}")
        super().__init__(2.0 ** initial_scale_power)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_loss_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = scale_factor
        self.rule = rule
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Advance one step; `overflow` must already agree across all ranks."""
        self.at_minimum = False
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.at_minimum = self.scale <= self.min_scale
                if self.at_minimum and self.rule == "deepspeed":
                    raise LossScaleAtMinimumError(
                        f"fp16 overflow with the loss scale already at its minimum "
                        f"{self.scale:g} (fp16.min_loss_scale): DeepSpeed stops here too; "
                        f"lower the lr, clip gradients or train in bf16")
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if self._grows():
                self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def _grows(self) -> bool:
        """Whether this clean step ends a growth window under the scaler's rule."""
        clean = self.iteration - self.last_overflow_iteration  # clean steps, this one included
        if self.rule == "deepspeed":  # DeepSpeed's stable_interval leaves the first one out
            return clean > 1 and (clean - 1) % self.window == 0
        return clean % self.window == 0

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
