"""Token dispatch for mixture-of-experts layers: the contract every dispatcher keeps.

A dispatcher moves each token's hidden state to the ranks that hold its chosen experts and
brings the expert outputs back. `dispatch` returns this rank's rows for its local experts,
expert-major (all rows of local expert 0, then of local expert 1, ...) with the count per
local expert; `combine` takes the experts' outputs for exactly those rows and returns, for
every token of the input, the router-probability-weighted sum over its experts (Megatron-Core
applies the probabilities at un-permutation: moe_apply_probs_on_input is not supported).

`LocalDispatcher` is the one-rank case (expert-parallel size 1): permutation only. The
expert-parallel dispatchers (all-to-all, all-gather) keep the same contract, so a layer with
any of them computes the same function; autograd flows through dispatch and combine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class Dispatched:
    """This rank's share of a dispatch."""

    rows: torch.Tensor
    """[R, h]: the hidden states sent to this rank's local experts, expert-major."""
    tokens_per_expert: torch.Tensor
    """[local experts] int64 on rows' device: how many of `rows` each local expert takes."""
    state: Any
    """What `combine` needs to return the outputs (dispatcher-specific)."""


class TokenDispatcher(Protocol):
    """Moves tokens to their experts' ranks and back (see the module docstring)."""

    num_local_experts: int

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        """hidden [T, h], probs [T, E] (0 where not routed), bool routing_map [T, E]."""
        ...

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """expert_output [R, h] for `dispatched.rows` -> [T, h], weighted by the probs."""
        ...


def permute(hidden: torch.Tensor, routing_map: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per chosen expert, expert-major: (rows, their token ids, counts
    per expert as int64)."""
    num_tokens, num_experts = routing_map.shape
    expert_major = routing_map.t().contiguous()
    token_indices = torch.arange(num_tokens, device=hidden.device).expand(num_experts, -1)
    token_indices = token_indices.masked_select(expert_major)
    tokens_per_expert = expert_major.sum(dim=1)
    return hidden.index_select(0, token_indices), token_indices, tokens_per_expert


def unpermute(expert_output: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
              token_indices: torch.Tensor) -> torch.Tensor:
    """Weight each expert row by its router probability and sum it back into its token."""
    row_probs = probs.t().contiguous().masked_select(routing_map.t().contiguous())
    weighted = (expert_output * row_probs.unsqueeze(-1)).to(expert_output.dtype)
    output = expert_output.new_zeros(routing_map.shape[0], expert_output.shape[-1])
    return output.index_add(0, token_indices, weighted)


class LocalDispatcher:
    """Every expert on this rank: dispatch is a permutation, combine its weighted inverse."""

    def __init__(self, num_experts: int) -> None:
        self.num_local_experts = num_experts

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        rows, token_indices, tokens_per_expert = permute(hidden, routing_map)
        return Dispatched(rows, tokens_per_expert, (probs, routing_map, token_indices))

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        probs, routing_map, token_indices = dispatched.state
        return unpermute(expert_output, probs, routing_map, token_indices)
