"""Megatron's mixture-of-experts flags (--num-experts and the --moe-* family) -> TransformerConfig.

Each flag keeps Megatron-LM's name, meaning and choices and sets the Megatron-Core
TransformerConfig field of the same name (--num-experts: `num_moe_experts`). Their defaults
are Megatron's, held by the TransformerConfig: a flag left out is None here so a --model zoo
MoE config shows through (as the model flags of settings.py). The rules of the MoE model
itself (top-k against the experts, expert bias needs sigmoid, capacity padding needs a
capacity factor...) are the model's (`TransformerConfig.problems`); this module adds the
flag-level ones: MoE flags on a dense model, --moe-layer-freq's forms, and the expert-parallel
sizes against the launch (`expert_parallel_problems`).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

MAX_LAYER_PATTERN = 100_000  # longest --moe-layer-freq list built (a guard, not Megatron's)
LAYER_FREQ_FORMS = ("an int N (every N-th layer, from the first, is an MoE layer) or a Python "
                    "list of 0/1 per layer, e.g. \"([1]*3+[0]*1)*2\"")


@dataclass(frozen=True)
class MoESettings:
    """Megatron-Core's mixture-of-experts flags (None: the --model zoo's value, else
    Megatron's default, named in each doc)."""

    num_experts: Optional[int] = setting(
        None, "routed experts per MoE layer (None: a dense model)", "--num-experts")
    moe_ffn_hidden_size: Optional[int] = setting(
        None, "inner width of each routed expert (default --ffn-hidden-size)",
        "--moe-ffn-hidden-size")
    moe_layer_freq: Optional[str] = setting(
        None, f"which layers are MoE layers: {LAYER_FREQ_FORMS} (default 1: every layer)",
        "--moe-layer-freq", metavar="N|PATTERN")
    moe_router_topk: Optional[int] = setting(
        None, "experts each token is routed to (default 2)", "--moe-router-topk")
    moe_router_score_function: Optional[str] = setting(
        None, "router scores: softmax or sigmoid of the logits (default softmax)",
        "--moe-router-score-function", choices=("softmax", "sigmoid"))
    moe_router_pre_softmax: Optional[bool] = setting(
        None, "apply the score function before top-k, not after it (Mixtral: after)",
        "--moe-router-pre-softmax")
    moe_router_topk_scaling_factor: Optional[float] = setting(
        None, "multiply the chosen experts' probabilities by this (default: no scaling)",
        "--moe-router-topk-scaling-factor")
    moe_router_num_groups: Optional[int] = setting(
        None, "expert groups of group-limited routing (DeepSeek-V3's node-limited routing)",
        "--moe-router-num-groups")
    moe_router_group_topk: Optional[int] = setting(
        None, "groups each token's experts are chosen from (with --moe-router-num-groups)",
        "--moe-router-group-topk")
    moe_router_load_balancing_type: Optional[str] = setting(
        None, "balancing: aux_loss (over the micro-batch), seq_aux_loss (per sequence), "
        "sinkhorn or none; global_aux_loss is not implemented (default aux_loss)",
        "--moe-router-load-balancing-type",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"))
    moe_aux_loss_coeff: Optional[float] = setting(
        None, "weight of the load-balancing loss in the training loss (default 0.0: off)",
        "--moe-aux-loss-coeff")
    moe_z_loss_coeff: Optional[float] = setting(
        None, "weight of the router z-loss (default: none)", "--moe-z-loss-coeff")
    moe_router_enable_expert_bias: Optional[bool] = setting(
        None, "aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the routing scores, "
        "moved after each step towards balance (needs --moe-router-score-function sigmoid)",
        "--moe-router-enable-expert-bias")
    moe_router_bias_update_rate: Optional[float] = setting(
        None, "step of the expert-bias update (default 0.001)", "--moe-router-bias-update-rate")
    moe_expert_capacity_factor: Optional[float] = setting(
        None, "expert capacity as a multiple of the even share: tokens above it are dropped "
        "(default: none, dropless; negative: none, as in Megatron)",
        "--moe-expert-capacity-factor")
    moe_token_drop_policy: Optional[str] = setting(
        None, "with a capacity: drop the lowest probabilities or the latest positions "
        "(default probs)", "--moe-token-drop-policy", choices=("probs", "position"))
    moe_pad_expert_input_to_capacity: Optional[bool] = setting(
        None, "fill every expert up to its capacity (needs --moe-expert-capacity-factor)",
        "--moe-pad-expert-input-to-capacity")
    moe_grouped_gemm: Optional[bool] = setting(
        None, "the local experts' matmuls as one grouped matmul (torch's, where the running "
        "torch has it, else a loop): the same numbers", "--moe-grouped-gemm")
    moe_shared_expert_intermediate_size: Optional[int] = setting(
        None, "inner width of the shared expert every token also goes through (default: none)",
        "--moe-shared-expert-intermediate-size")
    moe_token_dispatcher_type: Optional[str] = setting(
        None, "how tokens reach their experts' ranks: allgather or alltoall (the same numbers "
        "at --expert-model-parallel-size 1); flex (Megatron's DeepEP/HybridEP kernels for the "
        "same all-to-all exchange) runs gigatron's alltoall (default allgather)",
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall", "flex"))
    moe_router_dtype: Optional[str] = setting(
        None, "dtype of the router's logits and probabilities (default: the model's)",
        "--moe-router-dtype", choices=("fp32", "fp64"))
    moe_router_force_load_balancing: Optional[bool] = setting(
        None, "for benchmarking: each rank routes by standard-normal random logits of its "
        "own RNG instead of the router's (balanced load; the gradient passes straight through "
        "to the router, as Megatron-Core's RandomSTE; default off)",
        "--moe-router-force-load-balancing")


# MoESettings field -> TransformerConfig field (Megatron-Core's names)
MOE_FIELDS: Dict[str, str] = {f.name: f.name for f in fields(MoESettings)}
MOE_FIELDS["num_experts"] = "num_moe_experts"
# Megatron's choices gigatron does not build: (setting, value) -> the fix
NOT_IMPLEMENTED = {
    ("moe_router_load_balancing_type", "global_aux_loss"):
        "use aux_loss, seq_aux_loss, sinkhorn or none",
}
_POSITIVE = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_num_groups",
             "moe_router_group_topk", "moe_shared_expert_intermediate_size")


def parse_moe_layer_freq(text: str) -> Union[int, List[int]]:
    """--moe-layer-freq as Megatron reads it (an int, or a Python expression of a list of 0/1),
    evaluated without `eval`: only int and list literals, +, * and parentheses."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = _pattern_value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as err:
        raise ValueError(f"--moe-layer-freq {text!r}: give {LAYER_FREQ_FORMS}"
                         f"{f' ({err})' if isinstance(err, ValueError) and str(err) else ''}") \
            from None
    if not isinstance(value, list) or any(v not in (0, 1) for v in value):
        raise ValueError(f"--moe-layer-freq {text!r} is not a list of 0/1: give "
                         f"{LAYER_FREQ_FORMS}")
    return value


def _pattern_value(node: ast.AST) -> Union[int, List[int]]:
    """The value of a literal pattern expression; anything else is a ValueError."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.List):
        values = [_pattern_value(e) for e in node.elts]
        flat = [v for v in values if isinstance(v, int)]
        if len(flat) < len(values):
            raise ValueError("lists do not nest")
        return flat
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        if isinstance(left, int) and isinstance(right, int):
            return left + right if isinstance(node.op, ast.Add) else left * right
        if isinstance(node.op, ast.Add):
            if isinstance(left, list) and isinstance(right, list):
                return left + right
            raise ValueError("+ joins two lists")
        items: List[int]
        if isinstance(left, list) and isinstance(right, int):
            items, times = left, right
        elif isinstance(left, int) and isinstance(right, list):
            items, times = right, left
        else:
            raise ValueError("* repeats a list by an int")
        if len(items) * times > MAX_LAYER_PATTERN:
            raise ValueError(f"longer than {MAX_LAYER_PATTERN} layers")
        return items * times
    raise ValueError("only int and list literals, + and * are allowed")


def moe_overrides(s: "Settings", zoo: Optional[Dict[str, Any]],
                  p: "Problems") -> Dict[str, Any]:
    """The TransformerConfig fields the MoE flags set (only those given, so the zoo's show
    through); MoE flags on a dense model, bad sizes and forms are lines in `p`."""
    from gigatron.training.config.table import flag_name  # the table imports this module

    m = s.moe
    given = {name: getattr(m, name) for name in MOE_FIELDS if getattr(m, name) is not None}
    n = len(p.lines)
    p.positive(s, *(d for d in _POSITIVE if d in given))
    for (name, value), fix in NOT_IMPLEMENTED.items():
        if given.get(name) == value:
            p.add(f"{flag_name(name)} {value} is not implemented in gigatron: {fix}")
    if given.get("moe_token_dispatcher_type") == "flex":  # its kernels move tokens as alltoall
        given["moe_token_dispatcher_type"] = "alltoall"
    if "moe_layer_freq" in given:
        given["moe_layer_freq"] = p.run(parse_moe_layer_freq, given["moe_layer_freq"])
    if len(p.lines) > n:  # the model's own checks would repeat these lines
        return {}
    dense = m.num_experts is None and not (zoo or {}).get("num_moe_experts")
    others = [flag_name(n) for n in given if n != "num_experts"]
    if dense and others:
        one = len(others) == 1
        p.add(f"{', '.join(others)} set{'s' if one else ''} MoE layers but the model is "
              f"dense: add --num-experts N (or drop {'it' if one else 'them'})")
        return {}
    return {MOE_FIELDS[name]: value for name, value in given.items()}


def expert_parallel_problems(s: "Settings", dp: Optional[int], num_experts: Optional[int],
                             p: "Problems") -> None:
    """--expert-model-parallel-size and --expert-tensor-parallel-size against the launch and
    the experts (Megatron's rules: etp x ep divides the tp x cp x dp ranks of a pipeline stage,
    ep divides the experts, expert parallelism with tp > 1 needs --sequence-parallel)."""
    par = s.parallel
    n = len(p.lines)
    p.positive(s, "expert_model_parallel_size", "expert_tensor_parallel_size")
    if len(p.lines) > n:
        return
    cp = par.context_parallel_size  # the expert view folds ep over tp x cp x dp
    ep, etp, stage = par.ep, par.tp if par.etp is None else par.etp, par.tp * cp * (dp or 0)
    if stage and stage % (ep * etp):
        ranks = f"tensor x data parallel = {par.tp} x {dp}" if cp == 1 else \
            f"tensor x context x data parallel = {par.tp} x {cp} x {dp}"
        p.add(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = "
              f"{ep * etp} does not divide {ranks} = {stage} "
              f"(the ranks of a pipeline stage, which the expert layers split again): change "
              f"those flags or the launch size")
    if num_experts is None and ep > 1:
        p.add("--expert-model-parallel-size splits the experts of MoE layers but the model is "
              "dense: add --num-experts N (or drop it)")
        return
    if num_experts is not None and num_experts % ep:
        p.add(f"--num-experts {num_experts} is not a multiple of --expert-model-parallel-size "
              f"{ep}: each expert-parallel rank holds the same number of experts")
    if (ep > 1 or etp != par.tp) and par.tp > 1 and not par.sequence_parallel:
        p.add(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp} with "
              f"--tensor-model-parallel-size {par.tp} needs --sequence-parallel (as in "
              f"Megatron-Core: each tensor-parallel rank dispatches its own tokens): add it")
