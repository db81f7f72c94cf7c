"""Split backward (issue 29): B then W gives the unsplit backward's gradients, layer by layer."""
from __future__ import annotations

import pytest
import torch

from gigatron.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from gigatron.parallel.tensor.wgrad import WeightGradQueue, deferring


def _init(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module


def _grads(module: torch.nn.Module, x: torch.Tensor, split: bool, **kwargs):
    """(input grad, {name: param grad}); with `split`, W runs after B and after the input grad
    is read, so a weight grad left in B would show up before W."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    queue = WeightGradQueue() if split else None
    with deferring(queue):
        y = module(x, **kwargs)
        (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    if split:
        assert queue is not None
        assert module.weight is None or module.weight.grad is None, "W ran in B"
        assert len(queue) == 1
        queue.run()
        assert len(queue) == 0
    return x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


CASES = [
    ("column", lambda: ColumnParallelLinear(6, 4, bias=True)),
    ("column-no-bias", lambda: ColumnParallelLinear(6, 4, bias=False)),
    ("column-gather-output", lambda: ColumnParallelLinear(6, 4, gather_output=True)),
    ("row", lambda: RowParallelLinear(6, 5, bias=True)),
    ("row-no-bias", lambda: RowParallelLinear(6, 5, bias=False)),
    ("row-not-parallel-input", lambda: RowParallelLinear(6, 5, input_is_parallel=False)),
]


@pytest.mark.parametrize("name,make", CASES, ids=[c[0] for c in CASES])
def test_split_backward_equals_unsplit_backward(name, make):
    layer = _init(make(), seed=1)
    x = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(2))
    gx, grads = _grads(layer, x, split=False)
    gx_split, grads_split = _grads(layer, x, split=True)
    torch.testing.assert_close(gx_split, gx, rtol=0, atol=1e-6)
    assert grads.keys() == grads_split.keys() and grads
    for n in grads:
        torch.testing.assert_close(grads_split[n], grads[n], rtol=0, atol=1e-6)


def test_tied_output_weight_passed_to_forward_is_deferred_too():
    layer = ColumnParallelLinear(6, 4, bias=False, skip_weight_param=True)
    table = torch.nn.Parameter(torch.randn(4, 6))
    x = torch.randn(3, 2, 6)
    expected = torch.autograd.grad((layer(x, weight=table) ** 2).sum(), table)[0]
    queue = WeightGradQueue()
    with deferring(queue):
        (layer(x, weight=table) ** 2).sum().backward()
    assert table.grad is None and len(queue) == 1
    queue.run()
    torch.testing.assert_close(table.grad, expected, rtol=0, atol=1e-6)


def test_w_accumulates_and_fires_post_accumulate_grad_hooks_at_w():
    """ZeRO's grad sync learns a grad is ready from this hook: it must fire at W, once per W."""
    layer = _init(RowParallelLinear(4, 3, bias=False), seed=3)
    fired = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    layer.weight.grad = torch.ones_like(layer.weight)
    x = torch.randn(2, 4)
    queue = WeightGradQueue()
    with deferring(queue):
        layer(x).sum().backward()
    assert fired == []
    queue.run()
    assert len(fired) == 1
    expected = torch.ones(3, 4) + torch.ones(3, 2) @ x
    torch.testing.assert_close(layer.weight.grad, expected, rtol=0, atol=1e-6)


def test_a_non_leaf_weight_is_not_deferred():
    layer = ColumnParallelLinear(4, 3, bias=False, skip_weight_param=True)
    base = torch.nn.Parameter(torch.randn(3, 4))
    queue = WeightGradQueue()
    with deferring(queue):
        layer(torch.randn(2, 4), weight=base * 2).sum().backward()
    assert len(queue) == 0 and base.grad is not None


def test_outside_deferring_the_linears_are_plain_f_linear():
    layer = ColumnParallelLinear(4, 3)
    y = layer(torch.randn(2, 4))
    assert "Addmm" in type(y.grad_fn).__name__ or "Linear" in type(y.grad_fn).__name__
