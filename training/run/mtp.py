"""The trainer's side of multi-token prediction: the "mtp_k loss" fields of the log line.

Each step the last stage's executor holds the depths' losses (models/mtp/loss.py: each
micro-batch's masked mean, summed over the step's micro-batches); `after_step` adds their
micro-batch mean on the device. At a log line (`log_fields`, collective: every rank) one
all-reduce brings them to every rank, averaged over the last-stage ranks (data-parallel
replicas; tp ranks hold the same values) and the interval's steps: Megatron-Core's
MTPLossLoggingHelper (tracked per step, averaged over the data-parallel group, shown as the
mean over the log interval).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch

from gigatron.models.mtp.loss import mtp_loss_name
from gigatron.parallel import comm


class MTPTraining:
    """One run's MTP loss bookkeeping: `after_step` once per step, `log_fields` per log line."""

    def __init__(self, depth: int, last_stage: bool, device: torch.device) -> None:
        self.names = [mtp_loss_name(k) for k in range(1, depth + 1)]
        self.last_stage, self.device = last_stage, device
        self.sums: Optional[torch.Tensor] = None
        self.steps = 0

    def after_step(self, aux_losses: Mapping[str, torch.Tensor], num_microbatches: int) -> None:
        """Add the step's depth losses (mean over its micro-batches); no host read."""
        self.steps += 1
        if not self.last_stage:
            return
        values = torch.stack([aux_losses[name].detach().double() for name in self.names])
        values = values / num_microbatches
        self.sums = values if self.sums is None else self.sums + values

    def log_fields(self) -> Dict[str, float]:
        """Collective: {"mtp_k loss": the interval's mean}; resets the interval."""
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        terms = torch.zeros(len(self.names) + 1, dtype=dtype, device=self.device)
        if self.last_stage and self.sums is not None:
            terms[:-1] = self.sums.to(dtype)
            terms[-1] = 1.0
        comm.all_reduce(terms)
        values = terms.tolist()
        ranks, steps = values[-1], self.steps
        self.sums, self.steps = None, 0
        if not ranks or not steps:
            return {}
        return {name: value / (ranks * steps) for name, value in zip(self.names, values)}


def mtp_training(depth: Optional[int], last_stage: bool,
                 device: torch.device) -> Optional[MTPTraining]:
    """The run's MTP bookkeeping; None without multi-token prediction."""
    return MTPTraining(depth, last_stage, device) if depth else None
