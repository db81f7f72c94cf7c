"""Adam without bias correction: DeepSpeed FusedAdam's `"bias_correction": false`.

BERT-era configs (DeepSpeedExamples' BingBertSquad among them) ask for it; torch's Adam
always corrects. Per element, at every step (DeepSpeed's multi_tensor_adam formulas):

    m = b1 m + (1 - b1) g            v = b2 v + (1 - b2) g^2
    decoupled (adam_w_mode):  w -= lr * (m / (sqrt(v) + eps) + weight_decay * w)
    L2 (adam_w_mode false):   g += weight_decay * w first, then w -= lr * m / (sqrt(v) + eps)

The update is elementwise, so ZeRO's sharding leaves it exact.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple

import torch


class UncorrectedAdam(torch.optim.Optimizer):
    """Adam/AdamW with bias_correction off (the moments are used as they are)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, decoupled: bool = True) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled=decoupled)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One update of every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict) -> None:
        beta1, beta2 = group["betas"]
        decay, grad = group["weight_decay"], p.grad
        assert grad is not None  # step() updates only parameters that have a gradient
        if decay and not group["decoupled"]:
            grad = grad.add(p, alpha=decay)
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        state["step"] += 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        update = m / (v.sqrt() + group["eps"])
        if decay and group["decoupled"]:
            update.add_(p, alpha=decay)
        p.add_(update, alpha=-group["lr"])
