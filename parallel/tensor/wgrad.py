"""Deferred weight gradients: the split backward of the zero-bubble pipeline schedules.

Megatron-Core's --delay-wgrad-compute. While a `WeightGradQueue` is active (`deferring`),
the linear layers (layers.py) run through `deferrable_linear`: their backward computes the
input gradient (and the bias gradient) at once, but the weight gradient, grad_output^T x,
is pushed to the queue as a unit of work and autograd gets None for the weight. The queue
is the one active at forward; the pipeline executor activates a (micro-batch, chunk)'s
queue around its forward and its input-gradient backward (B), so a forward recomputed
during B (activation checkpointing) defers too, and runs the queue at the schedule's
`WeightGrad` (W).

Running a unit accumulates the gradient through autograd itself (`torch.autograd.backward`
on the parameter): `.grad`, tensor hooks and post-accumulate-grad hooks fire exactly as in
an unsplit backward, so ZeRO's bucketed grad sync sees the parameter become ready at W.
A weight that is not a leaf (a cast or view of a parameter) is never deferred.

Memory (the W stash): from B to W a queue keeps, per deferred linear, exactly what its
weight gradient needs, its input x and its output's gradient (`held_tensors`); B has freed
the rest of the micro-batch's activations. Per token that is (in + out features) of every
deferred linear, as this rank holds them: Qi et al.'s 32sbh per transformer layer at 2-byte
activations, against 34sbh + 5as^2b of activations (training/plan/memory/ counts it).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F


class WeightGradQueue:
    """The deferred weight-gradient computations of one (micro-batch, chunk)."""

    def __init__(self) -> None:
        # (parameter, its linear's input, the gradient of its output), in the order deferred
        self._units: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __len__(self) -> int:
        return len(self._units)

    def push(self, weight: torch.Tensor, x: torch.Tensor, grad_output: torch.Tensor) -> None:
        """Keep what `weight`'s gradient grad_output^T x needs until `run`."""
        self._units.append((weight, x.detach(), grad_output.detach()))

    def held_tensors(self) -> List[torch.Tensor]:
        """The W stash: the inputs and output gradients kept for `run` (parameters not
        included), so memory accounting can count them."""
        return [t for _, x, g in self._units for t in (x, g)]

    def run(self) -> None:
        """Compute and accumulate every deferred weight gradient, in the order deferred."""
        units, self._units = self._units, []
        for weight, x, grad_output in units:
            _accumulate_weight_grad(weight, x, grad_output)


_active: Optional[WeightGradQueue] = None


@contextlib.contextmanager
def deferring(queue: Optional[WeightGradQueue]) -> Iterator[None]:
    """Linear layers called (forward) or differentiated (backward) inside defer their
    weight gradients to `queue` (None: compute them in backward, as usual)."""
    global _active
    saved, _active = _active, queue
    try:
        yield
    finally:
        _active = saved


def active_queue() -> Optional[WeightGradQueue]:
    """The queue a linear called now defers its weight gradient to (None: not deferring);
    the overlapped tensor-parallel linears (async_tp.py) defer through it too."""
    return _active


def _accumulate_weight_grad(weight: torch.Tensor, x: torch.Tensor,
                            grad_output: torch.Tensor) -> None:
    grad = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
        x.reshape(-1, x.shape[-1]))
    torch.autograd.backward(weight, grad.to(weight.dtype))


class _DeferredWeightLinear(torch.autograd.Function):
    """y = x W^T + b whose backward pushes W's gradient to the queue active at forward.

    The parameter travels outside autograd's inputs (in `owner`): an input edge would make
    autograd visit its AccumulateGrad in B, which fires post-accumulate-grad hooks even
    with no gradient (the grad sync would count the parameter ready twice).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                bias: Optional[torch.Tensor], owner: List[torch.Tensor],
                _needs_grad: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        ctx.owner, ctx.queue = owner[0], _active  # the queue: backward may run on another thread
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):  # type: ignore[override]
        x, weight = ctx.saved_tensors
        grad_x = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        ctx.queue.push(ctx.owner, x, grad_output)
        return grad_x, None, grad_bias, None, None


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, whose weight gradient is deferred when called inside `deferring(queue)` on
    a trainable leaf weight (otherwise: exactly F.linear)."""
    if (_active is None or not torch.is_grad_enabled() or not weight.is_leaf
            or not weight.requires_grad):
        return F.linear(x, weight, bias)
    return _DeferredWeightLinear.apply(x, weight.detach(), bias, [weight], _NEEDS_GRAD)


# an input that requires grad, so the output does even when only the weight does (a first
# layer on raw data): backward must reach this node to defer the weight's gradient
_NEEDS_GRAD = torch.empty(0, requires_grad=True)
