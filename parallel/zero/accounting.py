"""Memory and communication accounting: what a rank holds, measured and by the ZeRO formula.

ZeRO paper (Rajbhandari et al. 2020), per rank, for Ψ parameters and dp degree N_d:
  stage 0: (P + G + K)·Ψ        stage 1: (P + G)·Ψ + K·Ψ/N_d
  stage 2: P·Ψ + (G + K)·Ψ/N_d  stage 3: (P + G + K)·Ψ/N_d
with P, G the bytes per parameter and gradient element and K the bytes of master weights plus
optimizer state (the paper's mixed-precision Adam: P = G = 2, K = 4 + 8 = 12).
Here gradients are stored in the dtype they are reduced in (ZeroConfig.grad_reduce_dtype: G = 4
for fp32, as Megatron under --bf16 or --accumulate-allreduce-grads-in-fp32; 2 for fp16/bf16).
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from gigatron.parallel.zero.optimizer import ZeroOptimizer


@dataclass
class MemoryBytes:
    """Bytes this rank holds, per kind of state."""

    params: float
    grads: float
    master_params: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master_params + self.optimizer_state


def zero_memory_formula(num_params: int, dp_size: int, zero_stage: int, param_bytes: int = 2,
                        grad_bytes: int = 4, master_bytes: int = 4,
                        optimizer_state_bytes: int = 8) -> MemoryBytes:
    """The ZeRO paper's per-rank memory for `num_params` parameters on this rank's model part
    (optimizer_state_bytes per parameter: 8 for Adam's two fp32 moments, 4 for momentum SGD)."""
    n = float(num_params)
    return MemoryBytes(
        params=n * param_bytes / (dp_size if zero_stage >= 3 else 1),
        grads=n * grad_bytes / (dp_size if zero_stage >= 2 else 1),
        master_params=n * master_bytes / (dp_size if zero_stage >= 1 else 1),
        optimizer_state=n * optimizer_state_bytes / (dp_size if zero_stage >= 1 else 1))


def zero_comm_bytes_formula(num_params: int, dp_size: int, zero_stage: int, grad_bytes: int,
                            param_bytes: Optional[int] = None) -> float:
    """Bytes one rank sends per step in dp collectives (ring algorithm), Ψ(N-1)/N per pass:
    stage 0 all-reduces grads (2 passes); stages 1-2 reduce-scatter grads and all-gather
    params (1 + 1); stage 3 gathers params for forward and again for backward (1 + 2).
    Grads travel in `grad_bytes` per element, params in `param_bytes` (default the same;
    e.g. 4 and 2 for bf16 params with fp32 grads)."""
    param_bytes = grad_bytes if param_bytes is None else param_bytes
    share = num_params * (dp_size - 1) / dp_size
    if zero_stage == 0:
        return 2 * share * grad_bytes
    gathers = 2 if zero_stage == 3 else 1
    return share * (grad_bytes + gathers * param_bytes)


def measure_memory(zero: "ZeroOptimizer") -> MemoryBytes:
    """What this rank's ZeroOptimizer holds right now (stage 3 counts gathered buffers too)."""
    params = grads = master = state = 0
    for g in zero.flat_groups:
        if g.stage == 3:
            params += _nbytes(g.param_shard)
            params += sum(b.param_full.untyped_storage().nbytes() for b in g.buckets)
        else:
            params += _nbytes(g.param_buffer)
        for grad in [g.grad_buffer, g.grad_shard] + [b.grad_full for b in g.buckets
                                                     if g.stage >= 2]:
            grads += 0 if grad is None else _nbytes(grad)
        master += 0 if g.master_aliases_params else _nbytes(g.master)
        for value in zero.optimizer.state.get(g.master, {}).values():
            if isinstance(value, torch.Tensor) and value.shape == g.master.shape:
                state += _nbytes(value)
    return MemoryBytes(params, grads, master, state)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
