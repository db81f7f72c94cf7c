"""MuonConfig: Muon's settings, named and defaulted as Megatron-LM's --muon-* flags."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, List, Mapping, Optional, Tuple

from gigatron.parallel.zero.muon.newton_schulz import (MATMUL_PRECISIONS, SCALE_MODES,
                                                       coefficient_problem)

TP_MODES = ("duplicated", "blockwise", "distributed")
SCALAR_OPTIMIZERS = ("adam",)


@dataclass(frozen=True)
class MuonConfig:
    """How matrices are updated under --optimizer muon (the rest: the scalar optimizer)."""

    momentum: float = 0.9
    """EMA momentum of the gradient (Megatron-LM's default; torch.optim.Muon's is 0.95)."""
    nesterov: bool = False
    """Orthogonalise grad.lerp(momentum, beta) instead of the momentum itself."""
    num_ns_steps: int = 5
    coefficient_type: str = "quintic"
    scale_mode: str = "spectral"
    extra_scale_factor: float = 1.0
    split_qkv: bool = True
    """Orthogonalise a fused qkv weight's q, k and v rows (per query group) separately."""
    fp32_matmul_prec: str = "medium"
    tp_mode: str = "duplicated"
    """A tensor-parallel matrix: 'duplicated' gathers it whole, orthogonalises and keeps this
    rank's shard (equal to one device); 'blockwise' orthogonalises each shard on its own;
    'distributed' keeps it sharded and sums the norm and Gram matrices over tp."""
    scalar_optimizer: str = "adam"
    """For embeddings, the output layer, norms and biases (AdamW with the adam flags)."""
    qkv_split_shapes: Optional[Tuple[int, ...]] = None
    """Rows of q, k and v per query group in a fused qkv weight (from the model config)."""

    def __post_init__(self) -> None:
        problems = muon_problems(vars(self))
        if problems:
            raise ValueError("\n".join(problems))


def muon_problems(values: Mapping[str, Any],
                  names: Optional[Mapping[str, str]] = None) -> List[str]:
    """Every bad MuonConfig value in `values` (field -> value), one line each, naming the
    field as `names` spells it (a flag; default the field name) and the fix."""
    def n(field: str) -> str:
        return (names or {}).get(field, field)

    v = {**_DEFAULTS, **values}
    problem = coefficient_problem(v["coefficient_type"], v["num_ns_steps"])
    rules = [
        (0.0 <= v["momentum"] < 1.0, f"{n('momentum')} must be in [0, 1), got {v['momentum']!r}"),
        (not problem, f"{n('coefficient_type')} {v['coefficient_type']} with "
                      f"{n('num_ns_steps')} {v['num_ns_steps']}: {problem}"),
        (v["scale_mode"] in SCALE_MODES,
         f"{n('scale_mode')} must be one of {', '.join(SCALE_MODES)}, got {v['scale_mode']!r}"),
        (v["extra_scale_factor"] > 0,
         f"{n('extra_scale_factor')} must be > 0, got {v['extra_scale_factor']!r}"),
        (v["fp32_matmul_prec"] in MATMUL_PRECISIONS,
         f"{n('fp32_matmul_prec')} {v['fp32_matmul_prec']!r} is not a torch float32 matmul "
         f"precision (Megatron-LM fails on 'low' too): use medium (bf16 iterations) or high"),
        (v["tp_mode"] in TP_MODES,
         f"{n('tp_mode')} must be duplicated, blockwise or distributed, got "
         f"{v['tp_mode']!r}"),
        (v["scalar_optimizer"] in SCALAR_OPTIMIZERS,
         f"{n('scalar_optimizer')} {v['scalar_optimizer']!r} is not built: use adam"),
    ]
    return [message for ok, message in rules if not ok]


_DEFAULTS = {f.name: f.default for f in fields(MuonConfig)}
