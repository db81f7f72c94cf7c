"""Muon as a torch optimizer: matrices by Muon, the other param groups by AdamW.

Param groups say which rule they take ("use_muon", as DeepSpeed's MuonWithAuxAdam): a Muon
group's tensors are either whole parameters (2-D, or stacked experts [E, in, out]) or ZeRO's
flat master shards, whose matrices `set_layouts` describes (layerwise.py). One step of a Muon
tensor, Megatron-Core's (emerging_optimizers' OrthogonalizedOptimizer) order:

    momentum.lerp_(grad, 1 - beta)                     # an EMA of the gradient
    u = grad.lerp(momentum, beta) if nesterov else momentum
    p *= 1 - lr * weight_decay                         # decoupled weight decay
    p -= lr * scale x extra_scale x NewtonSchulz(u)    # per matrix (matrices.py)

torch.optim.Muon computes the same with nesterov=True, scale_mode "shape_scaling",
coefficient_type "simple", extra_scale_factor 1 and bf16 iterations. The state of a Muon
tensor is "momentum_buffer"; of an AdamW tensor torch's "step", "exp_avg", "exp_avg_sq".

With `ns_method` ("gram" or "standard") this is DeepSpeed's Muon (deepspeed.py): its
orthogonalisation; with `updates_before_norm` (DeepSpeed's ZeRO 1-3) the momentum and the
orthogonalisation run before the gradient norm (`update_of`, called by ZeRO), the update
replaces the gradient and is clipped as one, and step() only decays and applies it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, Optional, Tuple

import torch

from gigatron.parallel.comm import Group
from gigatron.parallel.zero.muon.config import MuonConfig
from gigatron.parallel.zero.muon.deepspeed import DeepSpeedUpdate, deepspeed_units
from gigatron.parallel.zero.muon.layerwise import ShardedMatrices
from gigatron.parallel.zero.muon.matrices import MatrixUpdate, matrix_units


class Muon(torch.optim.Optimizer):
    """Muon for groups with use_muon=True (the default), AdamW for the others."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, weight_decay: float = 0.01,
                 config: Optional[MuonConfig] = None,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 tp_group: Group = None, expert_tp_group: Group = None,
                 adam_kwargs: Optional[Dict[str, Any]] = None, decoupled: bool = True,
                 ns_method: Optional[str] = None) -> None:
        self.config = config or MuonConfig()
        nesterov = self.config.nesterov or ns_method is not None  # DeepSpeed's: always
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=self.config.momentum,
                        nesterov=nesterov, use_muon=True, betas=tuple(betas), eps=eps)
        super().__init__(params, defaults)
        self.matrix_update = MatrixUpdate(self.config, tp_group, expert_tp_group)
        self.layouts: Dict[int, ShardedMatrices] = {}
        self.ns_method = ns_method  # DeepSpeed's Muon; a group's own "ns_method" wins
        self.updates_before_norm = False  # DeepSpeed's ZeRO 1-3 (see the module docstring)
        self._adam = self._make_adam(adam_kwargs or {}, decoupled)

    def _make_adam(self, kwargs: Dict[str, Any], decoupled: bool
                   ) -> Optional[torch.optim.Optimizer]:
        """An AdamW (Adam with L2 decay unless `decoupled`) stepping our non-Muon groups,
        sharing their dicts and our state."""
        groups = [g for g in self.param_groups if not g["use_muon"]]
        if not groups:
            return None
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        adam = cls([dict(g) for g in groups], **kwargs)
        for ours, its in zip(groups, adam.param_groups):
            for key, value in its.items():
                ours.setdefault(key, value)
        self._link(adam)
        return adam

    def _link(self, adam: torch.optim.Optimizer) -> None:
        adam.param_groups = [g for g in self.param_groups if not g["use_muon"]]
        adam.state = self.state

    def set_layouts(self, layouts: Dict[int, ShardedMatrices]) -> None:
        """ZeRO's flat master shards (by id): the matrices each one holds."""
        self.layouts = dict(layouts)

    def state_keys(self, param: torch.Tensor) -> Tuple[str, ...]:
        """The state `param` keeps: a resharded checkpoint gives each tensor only its own."""
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        if group["use_muon"]:
            return ("momentum_buffer",)
        return ("step", "exp_avg", "exp_avg_sq") + \
            (("max_exp_avg_sq",) if group.get("amsgrad") else ())

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if self._adam is not None:
            self._link(self._adam)

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                for p in group["params"]:
                    self._step_matrices(p, group)
        if self._adam is not None:
            self._adam.step()
        return loss

    def _step_matrices(self, p: torch.Tensor, group: Dict[str, Any]) -> None:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        update = grad if self.updates_before_norm else self.update_of(p, grad, group)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update, alpha=-group["lr"])

    def update_of(self, p: torch.Tensor, grad: torch.Tensor,
                  group: Optional[Dict[str, Any]] = None) -> torch.Tensor:
        """Advance `p`'s momentum with `grad` and return the orthogonalised update."""
        if group is None:
            group = next(g for g in self.param_groups if any(q is p for q in g["params"]))
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf, beta = state["momentum_buffer"], group["momentum"]
        if self.ns_method is None:
            buf.lerp_(grad, 1 - beta)
        else:  # DeepSpeed's: a non-finite gradient leaves the momentum as it was
            buf.copy_(torch.where(torch.isfinite(grad).all(), buf.lerp(grad, 1 - beta), buf))
        u = grad.lerp(buf, beta) if group["nesterov"] else buf
        return self._orthogonalized(p, u, group)

    def _orthogonalized(self, p: torch.Tensor, u: torch.Tensor,
                        group: Dict[str, Any]) -> torch.Tensor:
        rule = self.matrix_update if self.ns_method is None else \
            DeepSpeedUpdate(group.get("ns_method") or self.ns_method)
        layout = self.layouts.get(id(p))
        if layout is not None:
            return layout.update(u, rule)
        units = matrix_units(0, p, "", self.config) if self.ns_method is None else \
            deepspeed_units([p])
        flat = u.reshape(-1)
        return torch.cat([rule(unit, flat[unit.offset:unit.offset + unit.numel]
                               .view(unit.rows, unit.cols)).reshape(-1)
                          for unit in units]).view_as(p)
