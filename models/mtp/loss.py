"""The multi-token prediction losses of a micro-batch, as Megatron-Core adds them.

Depth k's per-token loss is masked by the loss mask rolled k places left (the last k places
0: they have no token k + 1 places ahead) and, like Megatron-Core's MTPLossAutoScaler,
back-propagated as mtp_loss_scaling_factor / mtp_num_layers x its masked mean (its masked
sum with --calculate-per-token-loss, which the step divides by the main loss's token count)
alongside the main loss. What is reported (the executor's aux losses, logged as "mtp_k loss")
is the unscaled masked mean, as Megatron-Core's MTPLossLoggingHelper tracks it; the main
"lm loss" stays the main model's alone.
"""
from __future__ import annotations

from typing import Dict

import torch

from gigatron.models.losses import GPTMicroBatch
from gigatron.models.mtp.block import roll_left


def mtp_loss_name(depth: int) -> str:
    """The logged name of depth `depth`'s loss (1-based, Megatron-Core's)."""
    return f"mtp_{depth} loss"


def _reported_with_grad_of(reported: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """`reported`'s value carrying `trained`'s gradient."""
    return reported.detach() + (trained - trained.detach())


def mtp_losses(per_token: torch.Tensor, batch: GPTMicroBatch, scaling_factor: float,
               sum_over_tokens: bool) -> Dict[str, torch.Tensor]:
    """`per_token` [D, b, s] (depth k's loss at [k - 1]) -> {"mtp_k loss": scalar}: each the
    masked mean for the log, with the gradient of its scaled training term."""
    depth = per_token.shape[0]
    mask = batch.get("loss_mask")
    mask = torch.ones_like(per_token[0]) if mask is None else mask.to(per_token.dtype)
    out: Dict[str, torch.Tensor] = {}
    for k in range(depth):
        mask = roll_left(mask)
        total = (per_token[k].float() * mask).sum()
        mean = total / mask.sum()
        trained = scaling_factor / depth * (total if sum_over_tokens else mean)
        out[mtp_loss_name(k + 1)] = _reported_with_grad_of(mean, trained)
    return out
