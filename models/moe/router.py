"""The MoE router with Megatron-Core's numerics: top-k choice, capacity drops, balancing losses.

Functions of tensors on any device, and the gating module `Router` that applies them;
nothing here talks to a process group. Where
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
from dataclasses import dataclass, field
from typing import Any, Dict, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

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
    force_load_balancing: bool = False
    """--moe-router-force-load-balancing: random logits replace the gating's (benchmarking)."""

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


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp scaling of exp(cost) [T, E] towards uniform row and column sums (the
    S-BASE balanced assignment), iterated until the column scale moves less than ``tol``.

    The loop's stopping test reads the error on the host once per iteration."""
    cost = torch.exp(cost)
    num_tokens, num_experts = cost.shape
    eps = 1e-8
    row_scale = cost.new_ones(num_tokens)
    col_scale = cost.new_ones(num_experts)
    previous, error = col_scale, math.inf
    while error > tol:
        row_scale = (1.0 / num_tokens) / ((cost * col_scale).sum(dim=1) + eps)
        col_scale = (1.0 / num_experts) / ((cost * row_scale.unsqueeze(1)).sum(dim=0) + eps)
        error = float((previous - col_scale).abs().mean())
        previous = col_scale
    return col_scale * cost * row_scale.unsqueeze(1)


def sinkhorn_routing(logits: torch.Tensor, topk: int,
                     training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) of Megatron's ``sinkhorn`` balancing: in training the experts are
    chosen on the Sinkhorn-balanced fp32 logits (no gradient), the weights are sigmoid (top-1)
    or softmax over all experts of the raw logits; in evaluation both come from the latter."""
    if topk == 1:
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
    with torch.no_grad():
        choose_by = sinkhorn(logits.float()) if training else scores
        indices = choose_by.topk(topk, dim=1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return scores * routing_map, routing_map


_ROUTER_DTYPES = {None: None, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class RouterOutput:
    """One routing of a batch of tokens."""

    probs: torch.Tensor
    """[T, E]: the weights of each token's experts (0 elsewhere), after capacity."""
    routing_map: torch.Tensor
    """[T, E] bool: which experts each token is dispatched to, after capacity."""
    routed_map: torch.Tensor
    """[T, E] bool: the top-k choice before capacity (its excess over routing_map: drops)."""
    losses: Dict[str, torch.Tensor] = field(default_factory=dict)
    """The balancing losses by layer-loss name, already multiplied by their coefficients."""


class RandomLogits(torch.autograd.Function):
    """--moe-router-force-load-balancing, as Megatron-Core's RandomSTE: standard-normal logits
    of this rank's RNG in forward (every expert equally likely: balanced load for benchmarks),
    the gradient passed straight through to the gating's logits in backward."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(logits).normal_()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Router(nn.Module):
    """The gating linear (weight [E, h]; with `add_bias` also ``bias`` [E], as Megatron-Core's
    router under --add-bias-linear), the routing, and the balancing losses; the expert bias
    is a buffer of fp32 ``expert_bias``."""

    def __init__(self, config: RouterConfig, hidden_size: int,
                 load_balancing_type: str = "aux_loss", aux_loss_coeff: float = 0.0,
                 z_loss_coeff: Optional[float] = None, router_dtype: Optional[str] = None,
                 init_method_std: float = 0.02, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, add_bias: bool = False) -> None:
        super().__init__()
        if load_balancing_type not in ("aux_loss", "seq_aux_loss", "sinkhorn", "none"):
            raise ValueError(f"--moe-router-load-balancing-type {load_balancing_type!r}: use "
                             "aux_loss, seq_aux_loss, sinkhorn or none")
        if router_dtype not in _ROUTER_DTYPES:
            raise ValueError(f"--moe-router-dtype {router_dtype!r}: use fp32 or fp64")
        self.config = config
        self.load_balancing_type = load_balancing_type
        self.aux_loss_coeff = aux_loss_coeff
        self.z_loss_coeff = z_loss_coeff
        self.router_dtype = _ROUTER_DTYPES[router_dtype]
        self.weight = nn.Parameter(torch.empty(config.num_experts, hidden_size,
                                               dtype=params_dtype, device=device))
        nn.init.normal_(self.weight, std=init_method_std)
        self.bias: Optional[nn.Parameter] = None
        if add_bias:  # drawn like the weight, as Megatron-Core's router initialises it
            self.bias = nn.Parameter(torch.empty(config.num_experts, dtype=params_dtype,
                                                 device=device))
            nn.init.normal_(self.bias, std=init_method_std)
        self.expert_bias: Optional[torch.Tensor]
        if config.enable_expert_bias:
            # fp32 whatever the model's dtype: the +-rate steps would vanish in bf16
            self.register_buffer("expert_bias", torch.zeros(config.num_experts,
                                                            dtype=torch.float32, device=device))
        else:
            self.expert_bias = None

    def gating(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [T, E] of hidden [T, h], in --moe-router-dtype (else the input's dtype)."""
        dtype = self.router_dtype or hidden.dtype
        bias = None if self.bias is None else self.bias.to(dtype)
        logits = F.linear(hidden.to(dtype), self.weight.to(dtype), bias)
        return RandomLogits.apply(logits) if self.config.force_load_balancing else logits

    def forward(self, hidden: torch.Tensor, seq_length: int,
                with_losses: bool = False) -> RouterOutput:
        """Route hidden [T, h] (T = seq_length x batch, sequence-major); `with_losses`: also
        the balancing losses Megatron-Core adds in training."""
        logits = self.gating(hidden)
        out = self.route_logits(logits)
        if with_losses:
            out.losses = self.balancing_losses(logits, seq_length)
        return out

    def route_logits(self, logits: torch.Tensor) -> RouterOutput:
        """The routing (no losses) of gating logits [T, E]."""
        config = self.config
        if self.load_balancing_type == "sinkhorn":
            probs, routed = sinkhorn_routing(logits, config.topk, self.training)
        else:
            probs, routed = topk_routing(logits, config, self.expert_bias)
        probs_kept, routing_map = probs, routed
        if config.capacity_factor is not None:
            probs_kept, routing_map = drop_over_capacity(probs, routed, config)
        return RouterOutput(probs_kept, routing_map, routed)

    def balancing_losses(self, logits: torch.Tensor, seq_length: int) -> Dict[str, torch.Tensor]:
        """The layer losses of this routing, by Megatron-Core's names: load_balancing_loss
        (aux_loss or seq_aux_loss, times --moe-aux-loss-coeff) and z_loss (times
        --moe-z-loss-coeff). Every token of the sequence is here (no rank holds a part of
        it), so none of Megatron-Core's token-count reductions is needed."""
        losses = {}
        coeff, topk = self.aux_loss_coeff, self.config.topk
        score_function = self.config.score_function
        if coeff > 0 and self.load_balancing_type == "aux_loss":
            losses["load_balancing_loss"] = aux_loss(logits, topk, score_function, coeff)
        elif coeff > 0 and self.load_balancing_type == "seq_aux_loss":
            losses["load_balancing_loss"] = seq_aux_loss(logits, seq_length, topk,
                                                         score_function, coeff)
        if self.z_loss_coeff is not None:
            losses["z_loss"] = z_loss(logits, self.z_loss_coeff)
        return losses
