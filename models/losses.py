"""The GPT language-model loss of a micro-batch, and the losses its layers add on the way.

A micro-batch's loss is the per-token cross-entropy (the last stage's output) masked by its
`loss_mask` (Megatron's: --eod-mask-loss zeroes the tokens after an end-of-document):
its mean over the unmasked tokens by default, or its sum with --calculate-per-token-loss,
whose step divides by the global batch's `loss_tokens` (training/run/per_token_loss.py).

Under context parallelism a rank holds 2 of the 2 x cp chunks of each sequence; its
micro-batch carries `loss_tokens_share`, the whole sequence's loss-mask count / cp (the
data split's, known before the split). The masked mean is then this rank's loss sum over
that share: the gradients ZeRO averages over data x context parallel ranks, and the logged
loss weighed by the share, equal one device's mean over the whole sequence.

`LayerLosses` is where a layer leaves a loss of its own during forward (a mixture-of-experts
router's load-balancing loss): the pipeline executor takes it after each chunk's forward
and back-propagates it with the micro-batch loss, on the stage that holds the layer.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence

import torch

GPTMicroBatch = Mapping[str, Any]  # Megatron's keys: input_ids, labels, loss_mask, position_ids


def masked_mean_loss(per_token_loss: torch.Tensor, batch: GPTMicroBatch) -> torch.Tensor:
    """Mean per-token loss over the batch's `loss_mask` (all tokens when it has none)."""
    mask = batch.get("loss_mask")
    if mask is None:
        return per_token_loss.float().mean()
    mask = mask.to(per_token_loss.dtype)
    share = batch.get("loss_tokens_share")  # context parallelism: the sequence's count / cp
    count = mask.sum().clamp(min=1) if share is None else share.float()
    return (per_token_loss.float() * mask).sum() / count


def masked_sum_loss(per_token_loss: torch.Tensor, batch: GPTMicroBatch) -> torch.Tensor:
    """Sum of the per-token loss over the batch's `loss_mask` (all tokens when it has none):
    the micro-batch loss of Megatron's --calculate-per-token-loss."""
    mask = batch.get("loss_mask")
    if mask is None:
        return per_token_loss.float().sum()
    return (per_token_loss.float() * mask.to(per_token_loss.dtype)).sum()


def loss_tokens(batches: Sequence[GPTMicroBatch]) -> torch.Tensor:
    """The tokens `masked_sum_loss` counts in these micro-batches (their loss_mask sum, or
    every label), as an int64 device tensor: known before the step, so the per-token loss
    can be divided by the global count during backward. Context-parallel shards count their
    `loss_tokens_share` (float64): summed over the cp ranks it is the sequences' count."""
    if batches and batches[0].get("loss_tokens_share") is not None:
        return torch.stack([b["loss_tokens_share"] for b in batches]).sum().to(torch.float64)
    counts = [b["loss_mask"].sum() if b.get("loss_mask") is not None
              else torch.tensor(b["labels"].numel(), device=b["labels"].device)
              for b in batches]
    return torch.stack(counts).sum().to(torch.int64)


class LayerLosses:
    """Scalar losses a model's layers add during forward, by name, until they are taken.

    One per model chunk, handed to the layers that add losses; a forward outside the
    pipeline executor (generation) should `take` them too, or drop the chunk's."""

    def __init__(self) -> None:
        self._pending: Dict[str, torch.Tensor] = {}

    def add(self, name: str, loss: torch.Tensor) -> None:
        """From a layer's forward: a scalar to add to the micro-batch's loss (summed with
        the other layers' of that name)."""
        if loss.numel() != 1:
            raise ValueError(f"layer loss {name!r} must be a scalar, got shape "
                             f"{tuple(loss.shape)}")
        seen = self._pending.get(name)
        self._pending[name] = loss.reshape(()) if seen is None else seen + loss.reshape(())

    def take(self) -> Dict[str, torch.Tensor]:
        """The losses added since the last take, which start the next forward empty."""
        taken, self._pending = self._pending, {}
        return taken
