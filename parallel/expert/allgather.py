"""All-gather token dispatch (--moe-token-dispatcher-type allgather), as Megatron-Core's.

Every rank of the expert model-parallel group (ep x etp) gathers all tokens with their
router probabilities and routing map, keeps the rows routed to its local experts, and the
combine weights its experts' outputs, scatters them back to token positions and
reduce-scatters, so each rank gets the full sum for its own tokens. Fixed-size collectives
only: no host read (the permutation's masked_select aside, as in `LocalDispatcher`).
"""
from __future__ import annotations

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.expert.dispatch import Dispatched, permute, unpermute
from gigatron.parallel.tensor.mappings import (
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)


class AllGatherDispatcher:
    """Gathers every token of the ep x etp group on each rank; each keeps its experts' rows.

    Every rank of the group must bring the same number of tokens (as Megatron-Core's, whose
    ranks hold equal sequence shards). `etp_group` None means etp 1.
    """

    def __init__(self, ep_group: Group, num_experts: int, etp_group: Group = None) -> None:
        self.ep_group, self.etp_group = ep_group, etp_group
        ep = comm.group_size(ep_group)
        if num_experts % ep:
            raise ValueError(f"--num-experts {num_experts} is not divisible by "
                             f"--expert-model-parallel-size {ep}: each expert-parallel "
                             f"rank holds num_experts / ep experts")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep
        self.first_expert = comm.group_rank(ep_group) * self.num_local_experts

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        """x of every rank of the group along dim 0 (ep-major inside etp); backward sums."""
        x = gather_from_sequence_parallel_region(x, self.ep_group, True)
        if self.etp_group is not None:
            x = gather_from_sequence_parallel_region(x, self.etp_group, True)
        return x

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        """This rank's rows for its local experts, local-expert-major (contract: dispatch.py)."""
        local = slice(self.first_expert, self.first_expert + self.num_local_experts)
        all_hidden = self._gather(hidden)
        local_probs = self._gather(probs)[:, local]
        # gloo gathers no bools: move the routing map as bytes
        local_map = self._gather(routing_map.to(torch.uint8))[:, local].bool()
        rows, token_indices, tokens_per_expert = permute(all_hidden, local_map)
        return Dispatched(rows, tokens_per_expert, (local_probs, local_map, token_indices))

    def combine(self, expert_output: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Weighted outputs at every gathered token, summed over the group, this rank's kept."""
        local_probs, local_map, token_indices = dispatched.state
        out = unpermute(expert_output, local_probs, local_map, token_indices)
        if self.etp_group is not None:
            out = reduce_scatter_to_sequence_parallel_region(out, self.etp_group)
        return reduce_scatter_to_sequence_parallel_region(out, self.ep_group)
