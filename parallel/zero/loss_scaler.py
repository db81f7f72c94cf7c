"""Loss scaling for fp16 training, with DeepSpeed's dynamic-scaling semantics.

Dynamic scaling (DeepSpeed `fp16` section): start at 2**initial_scale_power. On an overflow
the step is skipped; if hysteresis is exhausted (its counter is 1) the scale is divided by 2
(never below min_loss_scale), otherwise the counter is decremented and the scale kept. After
every run of loss_scale_window clean steps since the last overflow the scale doubles and the
hysteresis counter is refilled; with consecutive_hysteresis it is also refilled on every
clean step.
"""
from __future__ import annotations

from typing import Any, Dict


class LossScaler:
    """A static loss scale (1.0 for bf16/fp32; `loss_scale` > 0 for static fp16)."""

    dynamic = False
    # the last update was an overflow that a dynamic scale could not answer by backing off,
    # being at its floor (DeepSpeed's "Current loss scale already at minimum")
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
    `loss_scale_window` clean steps."""

    dynamic = True

    def __init__(self, initial_scale_power: int = 16, loss_scale_window: int = 1000,
                 hysteresis: int = 2, min_loss_scale: float = 1.0,
                 consecutive_hysteresis: bool = False, scale_factor: float = 2.0) -> None:
        super().__init__(2.0 ** initial_scale_power)
        self.window = loss_scale_window
        self.hysteresis = hysteresis
        self.min_scale = float(min_loss_scale)
        self.consecutive_hysteresis = consecutive_hysteresis
        self.factor = scale_factor
        self.hysteresis_left = hysteresis
        self.iteration = 0
        self.last_overflow_iteration = -1

    def update(self, overflow: bool) -> None:
        """Advance one step; `overflow` must already agree across all ranks."""
        self.at_minimum = False
        if overflow:
            if self.hysteresis == 1 or self.hysteresis_left == 1:
                self.at_minimum = self.scale <= self.min_scale
                self.scale = max(self.scale / self.factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.last_overflow_iteration = self.iteration
        else:
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            if (self.iteration - self.last_overflow_iteration) % self.window == 0:
                self.hysteresis_left = self.hysteresis
                self.scale *= self.factor
        self.iteration += 1

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": self.scale, "hysteresis_left": self.hysteresis_left,
                "iteration": self.iteration,
                "last_overflow_iteration": self.last_overflow_iteration}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.hysteresis_left = int(state["hysteresis_left"])
        self.iteration = int(state["iteration"])
        self.last_overflow_iteration = int(state["last_overflow_iteration"])
