"""Selective recomputation by module (Megatron-Core) or by op (torchtitan) -> TransformerConfig.

--recompute-modules keeps Megatron-Core's name, choices and default (None: ['core_attn'])
and, as there, applies only with --recompute-granularity selective (without it the list is
ignored, as Megatron-Core ignores it). Of Megatron-Core's choices core_attn, mlp, moe,
shared_experts, layernorm and mla_up_proj are implemented (the last two as a checkpoint of
the submodule, numerically identical); moe_act is refused with a reason (models/config.py
RECOMPUTE_MODULES). --selective-ac-option op is torchtitan's
`activation_checkpoint.selective_ac_option = "op"` (with its `mode = "selective"`: here
--recompute-granularity selective): each layer is checkpointed and keeps only its matmul
outputs except every second one and the attention kernel's (parallel/tensor/selective.py).
torchtitan's other value, an integer (every n-th layer recomputed whole), is not taken.
Megatron's deprecated --moe-layer-recompute is selective with 'moe' added to the modules.
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
        "(core attention), mlp (dense MLP), moe (MoE layer), shared_experts, layernorm (each "
        "layer's input_layernorm and pre_mlp_layernorm) and mla_up_proj (multi-latent "
        "attention's up-projections and RoPE: queries, keys and values from the latents) "
        "(Megatron-Core's default: core_attn; moe_act is not implemented). layernorm and "
        "mla_up_proj run as a checkpoint of that submodule, with the same numbers: its "
        "intermediates are dropped and recomputed in backward, but its output stays saved by "
        "the layer that reads it, where Megatron's output-discarding checkpoint frees that "
        "output too (layernorm: one [s, b, h] tensor per norm less there, next to nothing "
        "here; mla_up_proj: the up-projections' outputs before RoPE and the split are saved "
        "neither here nor there, the queries, keys and values there only)",
        "--recompute-modules", choices=MODULES)
    selective_ac_option: Optional[str] = setting(
        None, "with --recompute-granularity selective: op recomputes by torchtitan's op rule "
        "instead of by module (each layer keeps its matmul outputs except every second one "
        "and the attention kernel's; torchtitan's activation_checkpoint.selective_ac_option)",
        "--selective-ac-option", choices=("op",))
    moe_layer_recompute: bool = setting(
        False, "Megatron's deprecated spelling of --recompute-granularity selective "
        "--recompute-modules with moe added (default core_attn moe)", "--moe-layer-recompute")


def recompute_overrides(s: "Settings", fields: Dict[str, Any], p: "Problems") -> Dict[str, Any]:
    """TransformerConfig fields these flags set; `fields`: the other model flags' (for the
    granularity)."""
    r = s.recompute
    from gigatron.models.config import RECOMPUTE_MODULES

    for module in r.recompute_modules or ():
        if RECOMPUTE_MODULES.get(module):
            p.add(f"--recompute-modules {module}: {RECOMPUTE_MODULES[module]}")
    modules = None if r.recompute_modules is None else list(r.recompute_modules)
    out: Dict[str, Any] = {}
    if r.moe_layer_recompute:  # as Megatron-Core's TransformerConfig.__post_init__
        if fields.get("recompute_granularity") == "full":
            p.add("--moe-layer-recompute with --recompute-granularity full: drop one "
                  "(Megatron refuses the pair too)")
        modules = ["core_attn"] if modules is None else modules
        modules = modules + ([] if "moe" in modules else ["moe"])
        out["recompute_granularity"] = "selective"
    if r.selective_ac_option is None:
        return out if modules is None else {**out, "recompute_modules": modules}
    if modules is not None:
        p.add("--selective-ac-option op replaces --recompute-modules (and "
              "--moe-layer-recompute): drop one")
    if fields.get("recompute_granularity") != "selective":
        p.add("--selective-ac-option needs --recompute-granularity selective: add it")
    return {**out, "selective_ac_option": r.selective_ac_option}
