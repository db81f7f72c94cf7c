"""The MoE router with Megatron-Core's numerics: top-k choice, capacity drops, balancing losses.

Pure functions of tensors on any device; nothing here talks to a process group. Where
Megatron-Core all-reduces token counts (over tensor x context parallel ranks for the
losses, over tensor x data x context ranks for the expert bias), the caller does the
reduction and passes the reduced counts in.

Naming follows Megatron-Core's router: ``logits`` come out of the gating linear layer,
``scores`` are logits after the score function, ``probs`` are the weights that combine
the selected experts' outputs, ``routing_map`` says which experts each token goes to.
Tensors are ``[num_tokens, num_experts]``; tokens are ordered sequence-major
(``[seq_length, batch_size]`` flattened), as Megatron's ``logits.view(-1, num_experts)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

ScoreFunction = Literal["softmax", "sigmoid"]
DropPolicy = Literal["probs", "position"]


@dataclass(frozen=True)
class RouterConfig:
    """The routing settings of one MoE layer, named after Megatron's ``--moe-router-*`` flags."""

    num_experts: int
    """--num-experts: routed experts per MoE layer."""
    topk: int = 2
    """--moe-router-topk: experts each token is sent to."""
    score_function: ScoreFunction = "softmax"
    """--moe-router-score-function: softmax or sigmoid of the logits."""
    pre_softmax: bool = False
    """--moe-router-pre-softmax: apply the score function before top-k instead of after."""
    topk_scaling_factor: float | None = None
    """--moe-router-topk-scaling-factor: multiplies the selected probs (None or 0: no scaling)."""
    num_groups: int | None = None
    """--moe-router-num-groups: expert groups for group-limited routing (DeepSeek-V2/V3)."""
    group_topk: int | None = None
    """--moe-router-group-topk: groups each token may pick its experts from."""
    enable_expert_bias: bool = False
    """--moe-router-enable-expert-bias: aux-loss-free balancing with a per-expert bias."""
    bias_update_rate: float = 1e-3
    """--moe-router-bias-update-rate: step of the expert-bias update (DeepSeek-V3's 1e-3)."""
    capacity_factor: float | None = None
    """--moe-expert-capacity-factor: capacity as a multiple of the even share; None: no drop."""
    drop_policy: DropPolicy = "probs"
    """--moe-token-drop-policy: over capacity, drop the lowest probs or the latest positions."""
    pad_to_capacity: bool = False
    """--moe-pad-expert-input-to-capacity: fill every expert up to its capacity."""

    def __post_init__(self) -> None:
        problems = router_config_problems(self)
        if problems:
            raise ValueError("\n".join(problems))


def router_config_problems(config: RouterConfig) -> list[str]:
    """Every inconsistency of a router config, one line each naming the flag and the fix."""
    problems = []
    if config.num_experts < 1 or not 1 <= config.topk <= config.num_experts:
        problems.append(f"--moe-router-topk {config.topk} must be between 1 and --num-experts "
                        f"{config.num_experts}")
    if config.score_function not in ("softmax", "sigmoid"):
        problems.append(f"--moe-router-score-function {config.score_function!r}: use softmax or "
                        "sigmoid")
    if config.topk == 1 and config.score_function == "softmax" and not config.pre_softmax:
        problems.append("--moe-router-topk 1 with softmax after top-k has zero gradient: add "
                        "--moe-router-pre-softmax")
    if config.enable_expert_bias and config.score_function != "sigmoid":
        problems.append("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if config.group_topk:
        groups = config.num_groups
        if not groups or config.num_experts % groups or config.group_topk > groups:
            problems.append(f"--moe-router-group-topk {config.group_topk} needs "
                            f"--moe-router-num-groups dividing --num-experts {config.num_experts} "
                            "and at least --moe-router-group-topk")
        elif config.topk > config.group_topk * (config.num_experts // groups):
            problems.append(f"--moe-router-topk {config.topk} exceeds the experts in "
                            f"--moe-router-group-topk {config.group_topk} groups: pick more groups")
    if config.drop_policy not in ("probs", "position"):
        problems.append(f"--moe-token-drop-policy {config.drop_policy!r}: use probs or position")
    if config.pad_to_capacity and config.capacity_factor is None:
        problems.append("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    return problems


def group_limited_topk(scores: torch.Tensor, topk: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts from the ``group_topk`` best groups only: bounds the devices a token reaches.

    A group's rank is the sum of its best ``topk // group_topk`` scores (DeepSeek-V3).
    """
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_rank = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)
    chosen_groups = group_rank.topk(group_topk, dim=-1, sorted=False).indices
    group_allowed = torch.zeros_like(group_rank, dtype=torch.bool).scatter(1, chosen_groups, True)
    expert_allowed = group_allowed.repeat_interleave(num_experts // num_groups, dim=1)
    top = scores.masked_fill(~expert_allowed, float("-inf")).topk(topk, dim=-1)
    return top.values, top.indices


def _select(scores: torch.Tensor, config: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the top-k, group-limited when the config says so."""
    if config.group_topk:
        assert config.num_groups is not None
        return group_limited_topk(scores, config.topk, config.num_groups, config.group_topk)
    top = scores.topk(config.topk, dim=1)
    return top.values, top.indices


def topk_routing(logits: torch.Tensor, config: RouterConfig,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) of the top-k experts per token, before any capacity limit.

    ``expert_bias`` (sigmoid only) shifts which experts are chosen, never their weights.
    """
    if logits.dim() != 2:
        raise ValueError("router logits must be [num_tokens, num_experts], got "
                         f"{tuple(logits.shape)}")
    if config.score_function == "softmax":
        if expert_bias is not None:
            raise ValueError("an expert bias needs --moe-router-score-function sigmoid")
        if config.pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            probs, indices = _select(scores, config)
        else:
            top_logits, indices = _select(logits, config)
            probs = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    else:
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is None:
            probs, indices = _select(scores, config)
        else:
            indices = _select(scores + expert_bias, config)[1]
            probs = scores.gather(1, indices)
        if config.topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if config.topk_scaling_factor:
        probs = probs * config.topk_scaling_factor
    routing_probs = torch.zeros_like(logits).scatter(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_probs, routing_map


def expert_capacity(num_tokens: int, num_experts: int, capacity_factor: float) -> int:
    """Token slots per expert: the even share of ``num_tokens`` times the factor, rounded up."""
    return math.ceil(num_tokens / num_experts * capacity_factor)


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor,
                       config: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) with each expert's tokens cut (or padded) to its capacity."""
    assert config.capacity_factor is not None
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens * config.topk, num_experts, config.capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        # Position keeps the routed tokens torch.topk finds first among equal 1s, as Megatron.
        rank_by = probs if config.drop_policy == "probs" else routing_map.int()
        kept = rank_by.topk(capacity, dim=0, sorted=False).indices
        keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    final_map = keep if config.pad_to_capacity else routing_map & keep
    return probs * final_map, final_map


def route(logits: torch.Tensor, config: RouterConfig,
          expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) for dispatching tokens: top-k selection, then the capacity limit."""
    probs, routing_map = topk_routing(logits, config, expert_bias)
    if config.capacity_factor is not None:
        probs, routing_map = drop_over_capacity(probs, routing_map, config)
    return probs, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int,
                        score_function: ScoreFunction) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing_map, scores) the balancing losses see: plain top-k of normalised scores.

    Megatron ignores groups, expert bias and capacity here; sigmoid scores are normalised
    over all experts.
    """
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return routing_map, scores


def switch_load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                               total_num_tokens: int, topk: int, num_experts: int,
                               coeff: float) -> torch.Tensor:
    """Switch Transformer's aux loss ``coeff * E * sum_i f_i * P_i``, gradients through ``scores``.

    ``f_i = tokens_per_expert_i / (T * topk)`` and ``P_i = sum of scores_i / T`` with
    ``T = total_num_tokens``; counts and T may be reduced over ranks, scores stay local.
    """
    weighted = (scores.sum(dim=0) * tokens_per_expert).sum()
    return weighted * (num_experts * coeff / (topk * total_num_tokens * total_num_tokens))


def aux_loss(logits: torch.Tensor, topk: int, score_function: ScoreFunction,
             coeff: float) -> torch.Tensor:
    """Megatron's ``aux_loss`` balancing type over this batch of tokens (one rank's view)."""
    routing_map, scores = scores_for_aux_loss(logits, topk, score_function)
    num_tokens, num_experts = logits.shape
    return switch_load_balancing_loss(scores, routing_map.sum(dim=0), num_tokens, topk,
                                      num_experts, coeff)


def seq_aux_loss(logits: torch.Tensor, seq_length: int, topk: int,
                 score_function: ScoreFunction, coeff: float) -> torch.Tensor:
    """Megatron's ``seq_aux_loss``: the switch loss of each sequence, averaged over the batch.

    ``logits`` are ``[seq_length * batch_size, num_experts]``, sequence-major.
    """
    routing_map, scores = scores_for_aux_loss(logits, topk, score_function)
    num_experts = logits.shape[1]
    batch_size = logits.shape[0] // seq_length
    # Each (sequence, expert) pair counts as its own expert: [seq, batch * experts].
    per_sequence_scores = scores.reshape(seq_length, batch_size * num_experts)
    per_sequence_counts = routing_map.reshape(seq_length, batch_size * num_experts).sum(dim=0)
    summed = switch_load_balancing_loss(per_sequence_scores, per_sequence_counts, seq_length,
                                        topk, num_experts, coeff)
    return summed / batch_size


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's z-loss, ``coeff * mean(logsumexp(logits)^2)``: keeps router logits small.

    Megatron passes ``--moe-z-loss-coeff`` divided by the tensor x context parallel size.
    """
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


def updated_expert_bias(tokens_per_expert: torch.Tensor, expert_bias: torch.Tensor,
                        bias_update_rate: float) -> torch.Tensor:
    """The expert bias after one step of aux-loss-free balancing (arXiv 2408.15664).

    Under-loaded experts move up by ``bias_update_rate``, over-loaded ones down;
    ``tokens_per_expert`` is the count over the global batch (reduced by the caller).
    """
    with torch.no_grad():
        mean_load = tokens_per_expert.sum(dim=-1, keepdim=True) / tokens_per_expert.shape[-1]
        return expert_bias + torch.sign(mean_load - tokens_per_expert) * bias_update_rate
