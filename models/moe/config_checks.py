"""What TransformerConfig's mixture-of-experts fields must satisfy, and what they build.

Kept apart from models/config.py so the config file stays readable; nothing here imports a
model module (models/config.py calls `moe_problems` from its own `problems`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

from gigatron.models.moe.router import RouterConfig

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")
DROP_POLICIES = ("probs", "position")
DISPATCHER_TYPES = ("allgather", "alltoall")
ROUTER_DTYPES = (None, "fp32", "fp64")


def moe_layer_pattern(config: "TransformerConfig") -> List[bool]:
    """Which layers (global numbers 0 .. L-1) are MoE: Megatron-Core's moe_layer_freq, an int
    N (layers 0, N, 2N, ...) or a 0/1 list per layer; all False for a dense model."""
    layers = config.num_layers
    if config.num_moe_experts is None:
        return [False] * layers
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [i % freq == 0 for i in range(layers)]
    return [bool(flag) for flag in freq]


def router_config(config: "TransformerConfig") -> RouterConfig:
    """The RouterConfig of this model's MoE layers."""
    assert config.num_moe_experts is not None, "a dense model has no router"
    return RouterConfig(
        num_experts=config.num_moe_experts, topk=config.moe_router_topk,
        score_function=config.moe_router_score_function,  # type: ignore[arg-type]
        # sinkhorn picks its own activation: top-1 softmax's zero gradient does not arise
        pre_softmax=config.moe_router_pre_softmax
        or config.moe_router_load_balancing_type == "sinkhorn",
        topk_scaling_factor=config.moe_router_topk_scaling_factor,
        num_groups=config.moe_router_num_groups, group_topk=config.moe_router_group_topk,
        enable_expert_bias=config.moe_router_enable_expert_bias,
        bias_update_rate=config.moe_router_bias_update_rate,
        capacity_factor=config.moe_expert_capacity_factor,
        drop_policy=config.moe_token_drop_policy,  # type: ignore[arg-type]
        pad_to_capacity=config.moe_pad_expert_input_to_capacity,
        force_load_balancing=config.moe_router_force_load_balancing)


def moe_problems(config: "TransformerConfig", tp_size: int = 1) -> List[str]:
    """Every MoE field that cannot run, one line each naming the field and the fix."""
    experts = config.num_moe_experts
    if experts is None:
        set_fields = [name for name in ("moe_ffn_hidden_size",
                                        "moe_shared_expert_intermediate_size")
                      if getattr(config, name) is not None]
        return [f"{name} is set but num_moe_experts is None: set num_moe_experts "
                f"(--num-experts) or drop {name}" for name in set_fields]
    if not _positive_int(experts):
        return [f"num_moe_experts must be a positive integer (or None for a dense model), "
                f"got {experts!r}"]
    out = _choice_problems(config) + _routing_problems(config, experts)
    out += _layer_problems(config, tp_size)
    return out


def _choice_problems(config: "TransformerConfig") -> List[str]:
    choices = (("moe_router_score_function", SCORE_FUNCTIONS),
               ("moe_router_load_balancing_type", LOAD_BALANCING_TYPES),
               ("moe_token_drop_policy", DROP_POLICIES),
               ("moe_token_dispatcher_type", DISPATCHER_TYPES),
               ("moe_router_dtype", ROUTER_DTYPES))
    return [f"{name}={getattr(config, name)!r} is not one of "
            f"{[a for a in allowed if a is not None]}"
            for name, allowed in choices if getattr(config, name) not in allowed]


def _routing_problems(config: "TransformerConfig", experts: int) -> List[str]:
    out = []
    topk, groups, group_topk = (config.moe_router_topk, config.moe_router_num_groups,
                                config.moe_router_group_topk)
    sinkhorn = config.moe_router_load_balancing_type == "sinkhorn"
    if not _positive_int(topk) or topk > experts:
        out.append(f"moe_router_topk ({topk!r}) must be between 1 and num_moe_experts "
                   f"({experts})")
    elif topk == 1 and config.moe_router_score_function == "softmax" \
            and not config.moe_router_pre_softmax and not sinkhorn:
        out.append("moe_router_topk 1 with softmax after top-k has zero gradient: set "
                   "moe_router_pre_softmax (--moe-router-pre-softmax)")
    if group_topk is not None and groups is None:
        out.append("moe_router_group_topk needs moe_router_num_groups "
                   "(--moe-router-num-groups)")
    if groups is not None and (not _positive_int(groups) or experts % groups):
        out.append(f"num_moe_experts ({experts}) must be divisible by moe_router_num_groups "
                   f"({groups!r})")
    elif groups is not None and group_topk is not None:
        if not _positive_int(group_topk) or group_topk > groups:
            out.append(f"moe_router_group_topk ({group_topk!r}) must be between 1 and "
                       f"moe_router_num_groups ({groups})")
        elif _positive_int(topk) and topk > group_topk * (experts // groups):
            out.append(f"moe_router_topk ({topk}) exceeds the {group_topk * (experts // groups)}"
                       f" experts of moe_router_group_topk ({group_topk}) groups: raise "
                       f"moe_router_group_topk")
    if config.moe_router_enable_expert_bias and config.moe_router_score_function != "sigmoid":
        out.append("moe_router_enable_expert_bias needs moe_router_score_function='sigmoid' "
                   "(--moe-router-score-function sigmoid)")
    if not config.moe_router_bias_update_rate >= 0:
        out.append(f"moe_router_bias_update_rate must be >= 0, got "
                   f"{config.moe_router_bias_update_rate}")
    return out + _balancing_problems(config)


def _balancing_problems(config: "TransformerConfig") -> List[str]:
    out = []
    sinkhorn = config.moe_router_load_balancing_type == "sinkhorn"
    if not config.moe_aux_loss_coeff >= 0:
        out.append(f"moe_aux_loss_coeff must be >= 0, got {config.moe_aux_loss_coeff}")
    elif sinkhorn and config.moe_aux_loss_coeff > 0:
        out.append("moe_aux_loss_coeff must be 0 with moe_router_load_balancing_type="
                   "'sinkhorn' (Megatron-Core's sinkhorn has no aux loss)")
    if config.moe_z_loss_coeff is not None and not config.moe_z_loss_coeff >= 0:
        out.append(f"moe_z_loss_coeff must be >= 0 (or None), got {config.moe_z_loss_coeff}")
    factor = config.moe_expert_capacity_factor
    if factor is not None and not factor > 0:
        out.append(f"moe_expert_capacity_factor must be > 0 (None or negative: dropless), "
                   f"got {factor}")
    elif factor is not None and sinkhorn:
        out.append("moe_expert_capacity_factor needs moe_router_load_balancing_type aux_loss, "
                   "seq_aux_loss or none (Megatron-Core drops no tokens with sinkhorn)")
    if config.moe_pad_expert_input_to_capacity and factor is None:
        out.append("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor "
                   "(--moe-expert-capacity-factor)")
    return out


def _layer_problems(config: "TransformerConfig", tp: int) -> List[str]:
    out = []
    freq = config.moe_layer_freq
    if isinstance(freq, bool) or not (isinstance(freq, (int, list))):
        out.append(f"moe_layer_freq must be an int or a list of 0/1 per layer, got {freq!r}")
    elif isinstance(freq, int) and freq < 1:
        out.append(f"moe_layer_freq must be >= 1, got {freq}")
    elif isinstance(freq, list) and len(freq) != config.num_layers:
        out.append(f"moe_layer_freq has {len(freq)} entries but num_layers is "
                   f"{config.num_layers}: give one 0/1 per layer")
    elif isinstance(freq, list) and any(flag not in (0, 1) for flag in freq):
        out.append(f"moe_layer_freq list must hold only 0 (dense) and 1 (MoE), got {freq}")
    if not _positive_int(config.moe_ffn_hidden_size):
        out.append(f"moe_ffn_hidden_size must be a positive integer, got "
                   f"{config.moe_ffn_hidden_size!r}")
    shared = config.moe_shared_expert_intermediate_size
    if shared is not None and (not _positive_int(shared) or shared % tp):
        out.append(f"moe_shared_expert_intermediate_size ({shared!r}) must be a positive "
                   f"multiple of the tensor-parallel size ({tp})")
    if config.moe_shared_expert_gate:
        out.append("moe_shared_expert_gate (--moe-shared-expert-gate) is not supported: "
                   "drop it (shared experts are added ungated)")
    if config.add_bias_linear and shared is not None:
        out.append("moe_shared_expert_intermediate_size needs add_bias_linear=False "
                   "(--disable-bias-linear): shared experts have no biases (as in "
                   "Megatron-Core)")
    return out


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
