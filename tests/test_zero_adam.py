"""Adam with DeepSpeed's "bias_correction": false: the formulas, the spec that builds it,
and ZeRO sharding leaving it exact (2 forked ranks, stage 2, against one process: 1e-6)."""
import pytest
import torch
import torch.nn as nn

from gigatron.parallel.zero import OptimizerSpec, ZeroConfig, build_zero
from gigatron.parallel.zero.adam import UncorrectedAdam
from gigatron.parallel.zero.optimizers import build_optimizer
from multirank import run_on_ranks


def _by_hand(w, grads, lr, betas, eps, decay, decoupled):
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for g in grads:
        if not decoupled:
            g = g + decay * w
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        update = m / (v.sqrt() + eps) + (decay * w if decoupled else 0)
        w = w - lr * update
    return w


@pytest.mark.parametrize("decoupled", [True, False])
def test_updates_follow_deepspeeds_uncorrected_formulas(decoupled):
    torch.manual_seed(0)
    w0, grads = torch.randn(10), [torch.randn(10) for _ in range(4)]
    p = nn.Parameter(w0.clone())
    opt = UncorrectedAdam([p], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05,
                          decoupled=decoupled)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected = _by_hand(w0, grads, 0.1, (0.8, 0.9), 1e-6, 0.05, decoupled)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
    # the first step of uncorrected Adam is (1-b1)/sqrt(1-b2) = 0.63 x Adam's: it differs
    q = nn.Parameter(w0.clone())
    torch_adam = torch.optim.AdamW([q], lr=0.1, betas=(0.8, 0.9), eps=1e-6, weight_decay=0)
    q.grad = grads[0].clone()
    torch_adam.step()
    assert not torch.allclose(q.detach(), _by_hand(w0, grads[:1], 0.1, (0.8, 0.9), 1e-6, 0, True))


def test_the_spec_builds_it_only_when_bias_correction_is_false():
    params = [{"params": [nn.Parameter(torch.zeros(3))]}]
    off = build_optimizer(OptimizerSpec("adam", extra={"bias_correction": False}), params)
    assert isinstance(off, UncorrectedAdam) and off.defaults["decoupled"]
    l2 = build_optimizer(OptimizerSpec("adam", adam_w_mode=False,
                                       extra={"bias_correction": False}), params)
    assert isinstance(l2, UncorrectedAdam) and not l2.defaults["decoupled"]
    assert type(build_optimizer(OptimizerSpec("adam"), params)) is torch.optim.AdamW


def _train(rank, world, stage):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    spec = OptimizerSpec("adam", lr=0.05, weight_decay=0.01, extra={"bias_correction": False})
    zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=16),
                      optimizer=spec)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        mine = slice(rank * 4 // world, (rank + 1) * 4 // world)
        zero.zero_grad()
        zero.backward(((model(x[mine]) - y[mine]) ** 2).mean())
        zero.step()
    with zero.gathered_parameters():
        return [p.detach().clone() for p in model.parameters()]


def test_zero_sharding_leaves_it_exact():
    single = _train(0, 1, 0)
    for rank_params in run_on_ranks(_train, 2, 2, timeout=60):
        for a, b in zip(rank_params, single):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
