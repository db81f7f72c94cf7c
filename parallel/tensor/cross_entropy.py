"""Cross-entropy over vocab-sharded logits, without ever gathering the full logits.

Each tp rank holds logits for its slice of the (padded) vocab. Three all-reduces of
[tokens]-sized tensors (max, sum of exps, target logit; a fourth for label smoothing)
give the exact loss. Padded vocab entries (index >= vocab_size) are excluded: they get
no probability and no gradient. Label smoothing follows torch's definition:
loss = (1 - eps) * nll + eps * mean over the real classes of -log p.
"""
from __future__ import annotations

from typing import Optional

import torch

from gigatron.parallel import comm
from gigatron.parallel.tensor.mappings import tp_rank, tp_size
from gigatron.parallel.comm import Group


def _all_reduce(t: torch.Tensor, group, op=comm.ReduceOp.SUM) -> None:
    if tp_size(group) > 1:
        comm.all_reduce(t, group=group, op=op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_size, label_smoothing, group):
        ctx.input_dtype = logits.dtype
        logits = logits.float()
        part = logits.shape[-1]
        start = tp_rank(group) * part
        valid = (torch.arange(start, start + part, device=logits.device) < vocab_size)
        logits = logits.masked_fill(~valid, float("-inf"))

        logits_max = logits.amax(dim=-1)
        _all_reduce(logits_max, group, comm.ReduceOp.MAX)
        shifted = logits - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        sums = torch.stack([sum_exp, target_logit])
        if label_smoothing > 0:
            sums = torch.cat([sums, shifted.masked_fill(~valid, 0.0).sum(-1).unsqueeze(0)])
        _all_reduce(sums, group)
        log_sum_exp = sums[0].log()
        loss = log_sum_exp - sums[1]
        if label_smoothing > 0:
            smooth = log_sum_exp - sums[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside, valid)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax.clone()
        hit = (~outside).to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0:
            grad -= valid.to(grad.dtype) * (eps / ctx.vocab_size)
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group: Group = None,
                                 vocab_size: Optional[int] = None,
                                 label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token fp32 loss from this rank's vocab slice of `logits` ([..., V_pad/tp]).

    `vocab_size` is the real (unpadded) vocab; entries beyond it are ignored.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    padded = logits.shape[-1] * tp_size(tp_group)
    vocab_size = padded if vocab_size is None else vocab_size
    if not 0 < vocab_size <= padded:
        raise ValueError(f"vocab_size {vocab_size} must be in 1..{padded} (the padded vocab)")
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_size, label_smoothing,
                                            tp_group)
