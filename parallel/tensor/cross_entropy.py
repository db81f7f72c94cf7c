"""Cross-entropy over vocab-sharded logits, without ever gathering the full logits.

Each tp rank holds logits for its slice of the (padded) vocab. Three all-reduces of
[tokens]-sized tensors (max, sum of exps, target logit; a fourth for label smoothing)
give the exact loss. Padded vocab entries (index >= vocab_size) are excluded: they get
no probability and no gradient. Label smoothing follows torch's definition:
loss = (1 - eps) * nll + eps * mean over the real classes of -log p.

Memory traffic (issue 33): the logits are [tokens, V/tp], the largest activation of a GPT
step, so the work is done in place on one private fp32 copy. Full passes over a
[tokens, V/tp] tensor, forward + backward, without / with label smoothing, for bf16 logits:
- before: 10 / 13 (fp32 copy, full-size masked_fill, amax, subtract into a new tensor, exp
  into a new tensor, sum, div_; smoothing: masked_fill + sum; backward: clone, [smoothing
  subtract], mul_, cast), four fp32 [tokens, V/tp] tensors alive at once in forward;
- now: 7 / 9 (fp32 copy, amax, sub_, exp_, sum, div_; smoothing: sum over the real columns;
  backward: [smoothing sub_ over the real columns], one multiply that writes the input
  dtype), one fp32 tensor. Padding is masked by filling only the padded tail columns, and
  backward turns the saved softmax into the gradient in place, so it can run only once.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

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
        # always a private copy: fp32 logits belong to the caller and are never modified
        work = logits.to(torch.float32, copy=True)
        part = work.shape[-1]
        start = tp_rank(group) * part
        real = min(max(vocab_size - start, 0), part)  # this slice's columns below vocab_size
        if real < part:
            work[..., real:] = float("-inf")

        logits_max = work.amax(dim=-1)
        _all_reduce(logits_max, group, comm.ReduceOp.MAX)
        work.sub_(logits_max.unsqueeze(-1))  # shifted logits from here on

        outside = (target < start) | (target >= start + part)
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = work.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0)
        terms = [target_logit]
        if label_smoothing > 0:
            terms.append(work[..., :real].sum(-1))

        sum_exp = work.exp_().sum(dim=-1)  # exps from here on
        sums = torch.stack([sum_exp, *terms])
        _all_reduce(sums, group)
        log_sum_exp = sums[0].log()
        loss = log_sum_exp - sums[1]
        if label_smoothing > 0:
            smooth = log_sum_exp - sums[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth

        softmax = work.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.label_smoothing = label_smoothing
        ctx.vocab_size = vocab_size
        ctx.real_columns = real
        ctx.consumed = False
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        if ctx.consumed:
            raise RuntimeError("vocab_parallel_cross_entropy: backward ran twice through the "
                               "same loss (retain_graph=True); its saved softmax became the "
                               "first gradient, so recompute the loss for a second backward")
        ctx.consumed = True
        grad, local_target, outside = ctx.saved_tensors  # the softmax, turned into the grad
        eps = ctx.label_smoothing
        hit = (~outside).to(grad.dtype) * (1.0 - eps)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit.unsqueeze(-1))
        if eps > 0:
            grad[..., :ctx.real_columns].sub_(eps / ctx.vocab_size)
        # the multiply by grad_loss writes the input dtype directly: no separate cast pass
        out = grad if ctx.input_dtype == torch.float32 else torch.empty_like(
            grad, dtype=ctx.input_dtype)
        torch.mul(grad, grad_loss.unsqueeze(-1), out=out)
        return out, None, None, None, None


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
