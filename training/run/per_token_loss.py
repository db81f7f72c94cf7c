"""--calculate-per-token-loss: Megatron-Core's loss normalisation by the global batch's tokens.

By default (Megatron's and gigatron's) each micro-batch's loss is its mean over its unmasked
tokens, and the step's gradient is that of the mean over micro-batches and data-parallel
replicas: every micro-batch weighs the same, however many tokens --eod-mask-loss left in it.
With --calculate-per-token-loss Megatron-Core's loss function returns the micro-batch's *sum*
over its unmasked tokens and their number; the schedule does not divide; the token counts
are summed over micro-batches and all-reduced over data-parallel ranks, and the summed (not
averaged) data-parallel gradients are scaled by 1 / that count (`finalize_model_grads`): the
gradient of sum(loss x mask) / sum(mask) over the whole global batch, so every token weighs
the same. The logged training loss of an iteration is the same ratio (Megatron's
`loss_reduced` of (sum, count) pairs), averaged over the iterations of a log interval; the
validation loss is the ratio over all its iterations.

Here the count is known before the step (the loss masks arrive with the batch): the last
pipeline stage all-reduces it over its data-parallel group first, and each micro-batch sum
is back-propagated divided by count / dp -- the gradients ZeRO then averages over dp are
Megatron's, without a pass over the gradients. Only the last stage reads loss masks, so only
its ranks count (they share a data-parallel group: no other stage takes part).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Mapping, Optional, Sequence

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.models.losses import loss_tokens

if TYPE_CHECKING:
    from gigatron.training.config.run_config import RunConfig


def per_token_loss(run: "RunConfig") -> bool:
    """Whether the run normalises its loss per token (--calculate-per-token-loss)."""
    return run.settings.loss.calculate_per_token_loss


def divisor_from_tokens(local_tokens: torch.Tensor, dp_group: Group) -> torch.Tensor:
    """count / dp, count = the tokens summed over the data-parallel group (collective over
    it; at least 1 token, as Megatron skips the scaling of an all-masked batch)."""
    total = local_tokens.clone()
    comm.all_reduce(total, dp_group)
    return total.clamp(min=1).to(torch.float32) / comm.group_size(dp_group)


def loss_divisor(enabled: bool, batches: Sequence[Mapping[str, Any]],
                 dp_group: Group) -> Optional[torch.Tensor]:
    """What the step's micro-batch loss sums are divided by (None: per-micro-batch means,
    Megatron's default); `enabled`: per-token loss on a rank that computes the loss."""
    if not enabled:
        return None
    return divisor_from_tokens(loss_tokens(batches), dp_group)


def step_loss(losses: List[torch.Tensor], divisor: Optional[torch.Tensor],
              batches: Sequence[Mapping[str, Any]] = (), dp_group: Group = None
              ) -> Optional[torch.Tensor]:
    """This rank's share of the step's logged loss, whose mean over the data-parallel ranks
    is Megatron's logged loss: the global batch's loss sum over its token count, with or
    without --calculate-per-token-loss (Megatron's loss function reports (sum, tokens) pairs
    either way). `losses` are micro-batch sums when `divisor` (the per-token loss's count/dp)
    is given, else micro-batch means, weighed here by their `batches`' tokens (a collective
    over `dp_group`: the last stage's ranks, as in `loss_divisor`)."""
    if not losses:
        return None
    if divisor is None:
        total, tokens = loss_sum_and_tokens(losses, batches, are_sums=False)
        return total / divisor_from_tokens(tokens, dp_group)
    return torch.stack(losses).sum() / divisor


def loss_sum_and_tokens(losses: List[torch.Tensor], batches: Sequence[Mapping[str, Any]],
                        are_sums: bool) -> "tuple[torch.Tensor, torch.Tensor]":
    """(the loss summed over the micro-batches' tokens, their token count): `losses` are
    per-micro-batch sums, or means (`are_sums` False) weighed here by their tokens."""
    assert len(losses) == len(batches), "one batch per micro-batch loss"
    counts = [loss_tokens([batch]) for batch in batches]
    total = torch.stack(losses).sum() if are_sums else \
        torch.stack([loss * n for loss, n in zip(losses, counts)]).sum()
    return total, torch.stack(counts).sum()


class EvalLoss:
    """The validation loss's terms on this rank over an evaluation: the loss sums and the
    token counts, the ratio over all iterations (Megatron's evaluate). `per_token`: the
    micro-batch losses are sums (--calculate-per-token-loss), else means, weighed by their
    tokens."""

    def __init__(self, per_token: bool, dp_group: Group) -> None:
        self.per_token, self.dp_group = per_token, dp_group
        self.total: Optional[torch.Tensor] = None
        self.tokens: Optional[torch.Tensor] = None

    def add(self, losses: List[torch.Tensor], batches: Sequence[Mapping[str, Any]]) -> None:
        """One iteration's micro-batch losses (none on a rank without the loss)."""
        if not losses:
            return
        local, count = loss_sum_and_tokens(losses, batches, are_sums=self.per_token)
        self.total = local if self.total is None else self.total + local
        self.tokens = count if self.tokens is None else self.tokens + count

    def result(self) -> "tuple[Optional[torch.Tensor], int]":
        """(this rank's term, 1: the ratio spans the whole evaluation) for
        `loop.mean_loss_over_ranks`; a collective over the data-parallel group on the ranks
        with the loss."""
        if self.total is None or self.tokens is None:
            return None, 1  # no loss on this rank; every rank must name the same steps
        return self.total / divisor_from_tokens(self.tokens, self.dp_group), 1
