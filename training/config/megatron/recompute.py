"""Selective recomputation by module (Megatron-Core) or by op (torchtitan) -> TransformerConfig.

--recompute-modules keeps Megatron-Core's name, choices and default (None: ['core_attn'])
and, as there, applies only with --recompute-granularity selective (without it the list is
ignored, as Megatron-Core ignores it). Of Megatron-Core's choices core_attn, mlp, moe and
shared_experts are implemented; moe_act, layernorm and mla_up_proj are refused with a reason
(models/config.py RECOMPUTE_MODULES). --selective-ac-option op is torchtitan's
`activation_checkpoint.selective_ac_option = "op"` (with its `mode = "selective"`: here
--recompute-granularity selective): each layer is checkpointed and keeps only its matmul
outputs except every second one and the attention kernel's (parallel/tensor/selective.py).
torchtitan's other value, an integer (every n-th layer recomputed whole), is not taken.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")


@dataclass(frozen=True)
class RecomputeSettings:
    """What --recompute-granularity selective recomputes."""

    recompute_modules: Optional[List[str]] = setting(
        None, "with --recompute-granularity selective: the modules recomputed, of core_attn "
        "(core attention), mlp (dense MLP), moe (MoE layer), shared_experts (Megatron-Core's "
        "default: core_attn; moe_act, layernorm and mla_up_proj are not implemented)",
        "--recompute-modules", choices=MODULES)
    selective_ac_option: Optional[str] = setting(
        None, "with --recompute-granularity selective: op recomputes by torchtitan's op rule "
        "instead of by module (each layer keeps its matmul outputs except every second one "
        "and the attention kernel's; torchtitan's activation_checkpoint.selective_ac_option)",
        "--selective-ac-option", choices=("op",))


def recompute_overrides(s: "Settings", fields: Dict[str, Any], p: "Problems") -> Dict[str, Any]:
    """TransformerConfig fields these flags set; `fields`: the other model flags' (for the
    granularity)."""
    r = s.recompute
    from gigatron.models.config import RECOMPUTE_MODULES

    for module in r.recompute_modules or ():
        if RECOMPUTE_MODULES.get(module):
            p.add(f"--recompute-modules {module}: {RECOMPUTE_MODULES[module]}")
    if r.selective_ac_option is None:
        return {} if r.recompute_modules is None else {"recompute_modules":
                                                       list(r.recompute_modules)}
    if r.recompute_modules is not None:
        p.add("--selective-ac-option op replaces --recompute-modules: drop one")
    if fields.get("recompute_granularity") != "selective":
        p.add("--selective-ac-option needs --recompute-granularity selective: add it")
    return {"selective_ac_option": r.selective_ac_option}
