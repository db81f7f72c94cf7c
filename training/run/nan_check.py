"""Megatron's --check-for-nan-in-loss-and-grad without a host read per step.

Each step records on the device whether its loss or grad norm was non-finite, keeping the
first such iteration (a sticky value, so nothing waits for the host). The record is read
where the loop talks to the host anyway: at each log line, before each checkpoint save (a
checkpoint is never written after a bad step) and at the end. Every rank reads it at the same
iteration (one MIN all-reduce), so all ranks stop together with the same message.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from gigatron.parallel import comm
from gigatron.parallel.zero.loss_scaler import LossScaler

_NONE = 2 ** 62  # "no bad step yet": larger than any iteration x world size
# fp16 gives up after this many skipped (overflowed) steps in a row, or sooner when an
# overflow finds the loss scale already at its floor (DeepSpeed's raise_error_at_min_scale)
MAX_CONSECUTIVE_SKIPS = 50


class NonFiniteLossError(ValueError):
    """Training produced a NaN/inf loss or grad norm; the message says where and what to do."""


class NonFiniteWatch:
    """The first iteration (and lowest rank) whose loss or grad norm was NaN/inf."""

    def __init__(self, device: torch.device, rank: int, world_size: int,
                 check_grad_norm: bool = True, loaded_iteration: int = 0,
                 save_dir: Optional[str] = None) -> None:
        self.rank, self.world_size, self.check_grad_norm = rank, world_size, check_grad_norm
        self.loaded_iteration, self.save_dir = loaded_iteration, save_dir
        # encoded as iteration * world_size + rank, so one MIN finds both
        self.first = torch.full((), _NONE, dtype=torch.int64, device=device)
        self.consecutive_skips = 0

    def observe(self, iteration: int, loss: Optional[torch.Tensor],
                grad_norm: Optional[torch.Tensor]) -> None:
        """Record this step on the device (no host read)."""
        values = [v.detach().float().reshape(()) for v in (loss, grad_norm if
                  self.check_grad_norm else None) if isinstance(v, torch.Tensor)]
        if not values:
            return
        bad = ~torch.isfinite(torch.stack(values)).all()
        here = torch.full_like(self.first, iteration * self.world_size + self.rank)
        self.first = torch.where(bad & (self.first == _NONE), here, self.first)

    def check(self, saved_iterations: List[int]) -> None:
        """Collective: raise NonFiniteLossError on every rank if any rank saw a bad step."""
        first = self.first.clone()
        comm.all_reduce(first, op=comm.ReduceOp.MIN)
        value = int(first.item())
        if value == _NONE:
            return
        iteration, rank = divmod(value, self.world_size)
        where = last_good_checkpoint(iteration, saved_iterations, self.loaded_iteration,
                                     self.save_dir)
        raise NonFiniteLossError(
            f"non-finite loss or grad norm at iteration {iteration} (first seen on rank "
            f"{rank}): {where}; lower --lr or raise --clip-grad (fp16 skips such steps through "
            f"loss scaling), or pass --no-check-for-nan-in-loss-and-grad to train on regardless")


    def count_skip(self, iteration: int, skipped: bool, scaler: LossScaler,
                   saved_iterations: List[int]) -> None:
        """fp16 (its skip is known on the host and agreed by all ranks): stop every rank when
        loss scaling cannot recover: an overflow at the scale's floor, or too many in a row."""
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if not skipped:
            return
        floor = scaler.at_minimum
        if not floor and self.consecutive_skips < MAX_CONSECUTIVE_SKIPS:
            return
        where = last_good_checkpoint(iteration - self.consecutive_skips + 1,
                                     saved_iterations, self.loaded_iteration,
                                     self.save_dir)
        why = (f"overflowed with the loss scale already at its minimum {scaler.scale:g} "
               f"(--min-loss-scale)"
               if floor else f"overflowed {self.consecutive_skips} times in a row")
        raise NonFiniteLossError(
            f"fp16 loss scaling gave up at iteration {iteration}: the step {why}, "
            f"{self.consecutive_skips} consecutive skipped steps (on every rank): {where}; "
            f"lower --lr or raise --clip-grad, or train in --bf16")


def last_good_checkpoint(bad_iteration: int, saved_iterations: List[int],
                         loaded_iteration: int, save_dir: Optional[str]) -> str:
    """Where to resume from: the newest checkpoint written before the bad step."""
    good = [i for i in saved_iterations if i < bad_iteration]
    if good and save_dir is not None:
        return f"the last good checkpoint is iteration {good[-1]} in --save {save_dir}"
    if loaded_iteration > 0:
        return f"the last good checkpoint is the one loaded (iteration {loaded_iteration})"
    return "no checkpoint was saved before it"
