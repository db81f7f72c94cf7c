"""Lamb (You et al. 2019, "Large Batch Optimization for Deep Learning") with the semantics of
DeepSpeed's FusedLamb, on any device, and correct over ZeRO's flat master shards.

Per parameter w with gradient g, at step t (DeepSpeed's defaults: bias_correction on, eps
outside the square root):
    m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay w
    r = clamp(||w|| / ||u||, min_coeff, max_coeff), or 1 when ||w|| or ||u|| is 0
    w = w - lr r u
The norms are of the whole parameter before the update. A ZeRO shard holds slices of many
parameters (and a parameter's other slices are on the other dp ranks), so the squared norms
are summed per parameter slice, then over the dp group in one all-reduce per step; every
rank then applies the trust ratio of the full parameter, as a single device would. (Under
tensor parallelism a parameter is this rank's tp slice, as for DeepSpeed's FusedLamb.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group

Pieces = List[Tuple[int, int]]  # (slot of the parameter, or -1 for padding; length)


@dataclass
class TrustRatioLayout:
    """Which parameter ("slot") each stretch of each stepped tensor belongs to; set by ZeRO,
    whose flat shards hold slices of many parameters whose other slices live on other ranks."""

    pieces: Dict[int, Pieces]  # id(tensor) -> its pieces in order, covering all of it
    num_slots: int
    group: Group = None  # the ranks holding the other slices (dp)
    reduce: bool = False  # False: every rank holds whole parameters, nothing to sum
    device: Optional[torch.device] = None  # where the all-reduce runs (masters may be on CPU)


def trust_ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, min_coeff: float,
                max_coeff: float) -> torch.Tensor:
    """||w|| / ||u|| clamped to [min_coeff, max_coeff]; 1 where either norm is 0 (FusedLamb)."""
    ratio = (w_norm / u_norm).clamp(min_coeff, max_coeff)
    return torch.where((w_norm > 0) & (u_norm > 0), ratio, torch.ones_like(ratio))


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's `"type": "Lamb"` in plain torch: FusedLamb's options, defaults and update."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        problems = lamb_problems(lr, betas, eps, weight_decay, max_coeff, min_coeff)
        if amsgrad:
            problems.append("Lamb has no AMSGrad variant (DeepSpeed's FusedLamb refuses it "
                            "too): remove amsgrad")
        if max_grad_norm:
            # FusedLamb clips only with norms handed to step(), which DeepSpeed never does
            problems.append(f"Lamb max_grad_norm={max_grad_norm!r} is not supported: clip "
                            f"with DeepSpeed's top-level gradient_clipping instead")
        if problems:
            raise ValueError("\n".join(problems))
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                        max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.layout: Optional[TrustRatioLayout] = None
        self._index: Dict[int, Tuple[List[int], torch.Tensor, torch.Tensor]] = {}

    def set_layout(self, layout: Optional[TrustRatioLayout]) -> None:
        """Step flat shards (ZeRO): norms are per parameter slot, summed over layout.group."""
        self.layout, self._index = layout, {}

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        """One Lamb update of every tensor with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = [(group, p) for group in self.param_groups for p in group["params"]
                if p.grad is not None]
        if not work:
            return loss
        layout = self.layout or self._whole_tensor_layout()
        updates = [self._direction(group, p) for group, p in work]
        norms = self._squared_norms(work, updates, layout).sqrt()
        for (group, p), u in zip(work, updates):
            lengths, slots, lengths_t = self._pieces_of(p, layout)
            coeff = trust_ratio(norms[0, slots], norms[1, slots], group["min_coeff"],
                                group["max_coeff"])
            factor = coeff.repeat_interleave(lengths_t, output_size=p.numel())
            p.addcmul_(factor.view_as(p), u, value=-group["lr"])
        return loss

    def _direction(self, group: Dict[str, Any], p: torch.Tensor) -> torch.Tensor:
        """Update the moments; return u = Adam's bias-corrected step + weight_decay * w."""
        state = self.state[p]
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        corrected = group["bias_correction"]
        bc1 = 1 - beta1 ** state["step"] if corrected else 1.0
        bc2 = 1 - beta2 ** state["step"] if corrected else 1.0
        v_hat = v / bc2
        denom = (v_hat.add_(group["eps"]).sqrt_() if group["eps_inside_sqrt"]
                 else v_hat.sqrt_().add_(group["eps"]))
        u = (m / bc1).div_(denom)
        if group["weight_decay"]:
            u.add_(p, alpha=group["weight_decay"])
        return u

    def _squared_norms(self, work: List[Tuple[Dict[str, Any], torch.Tensor]],
                       updates: List[torch.Tensor], layout: TrustRatioLayout) -> torch.Tensor:
        """[||w||^2, ||u||^2] per slot (the last column collects padding), whole parameters."""
        device = work[0][1].device
        sums = torch.zeros(2, layout.num_slots + 1, dtype=torch.float32, device=device)
        for (_, p), u in zip(work, updates):
            lengths, slots, _ = self._pieces_of(p, layout)
            for row, t in enumerate((p, u)):
                pieces = t.reshape(-1).float().split(lengths)
                sums[row].index_add_(0, slots, torch.stack([x.dot(x) for x in pieces]))
        if layout.reduce:
            on = layout.device or device
            wire = sums.to(on)
            comm.all_reduce(wire, group=layout.group)  # one collective for all parameters
            sums = wire.to(device)
        return sums

    def _pieces_of(self, p: torch.Tensor, layout: TrustRatioLayout
                   ) -> Tuple[List[int], torch.Tensor, torch.Tensor]:
        """(lengths, slot per piece with padding -> the last column, lengths as a tensor)."""
        cache = layout is self.layout  # the whole-tensor layout is rebuilt every step
        if cache and id(p) in self._index:
            return self._index[id(p)]
        pieces = layout.pieces.get(id(p))
        if pieces is None:
            raise ValueError("Lamb: a tensor it steps is not in its TrustRatioLayout: call "
                             "set_layout again after changing its param groups")
        lengths = [n for _, n in pieces]
        slots = torch.tensor([layout.num_slots if s < 0 else s for s, _ in pieces],
                             dtype=torch.long, device=p.device)
        entry = (lengths, slots, torch.tensor(lengths, dtype=torch.long, device=p.device))
        if cache:
            self._index[id(p)] = entry
        return entry

    def _whole_tensor_layout(self) -> TrustRatioLayout:
        """Without ZeRO every tensor is one whole parameter: one slot each, nothing to sum."""
        params = [p for group in self.param_groups for p in group["params"]]
        return TrustRatioLayout({id(p): [(i, p.numel())] for i, p in enumerate(params)},
                                len(params))


def lamb_problems(lr: float, betas: Tuple[float, float], eps: float, weight_decay: float,
                  max_coeff: float, min_coeff: float) -> List[str]:
    """Every bad Lamb option, one line each."""
    rules = [(lr >= 0, f"Lamb lr must be >= 0, got {lr!r}"),
             (eps >= 0, f"Lamb eps must be >= 0, got {eps!r}"),
             (weight_decay >= 0, f"Lamb weight_decay must be >= 0, got {weight_decay!r}"),
             (len(tuple(betas)) == 2 and all(0.0 <= b < 1.0 for b in betas),
              f"Lamb betas must be two numbers in [0, 1), got {betas!r}"),
             (0 < min_coeff <= max_coeff,
              f"Lamb needs 0 < min_coeff <= max_coeff, got min_coeff={min_coeff!r}, "
              f"max_coeff={max_coeff!r}")]
    return [message for ok, message in rules if not ok]
