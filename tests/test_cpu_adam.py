"""--optimizer-cpu-offload's Adam is torch's fused (vectorised) CPU kernel, not the CPU
default's single-tensor path, and steps the same values.

Tolerance: 1e-6 relative (L2) on the parameters and both moments after 5 steps of fp32
AdamW and Adam (the fused kernel evaluates the same formula in another order: ~1e-7 seen).
A ZeroOptimizer with offload steps the same master values as one without.
"""

import pytest
import torch
from torch import nn

from multirank import run_on_ranks

from gigatron.parallel.zero import ZeroConfig, build_zero
from gigatron.parallel.zero.optimizers import OptimizerSpec, build_optimizer

RTOL = 1e-6


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_cpu_adam_is_fused_and_steps_as_the_single_tensor_path(adam_w_mode):
    g = torch.Generator().manual_seed(0)
    shards = [nn.Parameter(torch.randn(n, generator=g)) for n in (1000, 37)]
    twins = [nn.Parameter(s.detach().clone()) for s in shards]
    spec = OptimizerSpec("adam", lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    ours = build_optimizer(spec, [{"params": shards}])
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    reference = cls(twins, lr=1e-2, weight_decay=0.1, foreach=False)
    assert ours.defaults["fused"] is True and type(ours) is cls
    for _ in range(5):
        for s, t in zip(shards, twins):
            s.grad = torch.randn(s.shape, generator=g)
            t.grad = s.grad.clone()
        ours.step()
        reference.step()
    for s, t in zip(shards, twins):
        assert _rel(s.detach(), t.detach()) < RTOL
        for key in ("exp_avg", "exp_avg_sq"):
            assert _rel(ours.state[s][key], reference.state[t][key]) < RTOL
    assert _rel(shards[0].detach(), torch.randn(1000, generator=g)) > 0.1  # it moved


def test_a_specs_own_foreach_or_fused_choice_is_kept():
    one = [{"params": [torch.zeros(2, requires_grad=True)]}]
    kept = build_optimizer(OptimizerSpec("adamw", extra={"foreach": True}), one)
    assert kept.defaults["foreach"] is True and not kept.defaults["fused"]
    sgd = build_optimizer(OptimizerSpec("sgd"), one)
    assert "fused" not in sgd.defaults or not sgd.defaults["fused"]


def test_fused_only_when_every_parameter_is_a_float_on_one_cpu_or_gpu_kind():
    from gigatron.parallel.zero.optimizers import _fusable

    cpu = torch.zeros(2)
    assert _fusable([{"params": [cpu]}, {"params": cpu.clone()}])
    assert not _fusable([{"params": [torch.zeros(2, device="meta")]}])
    assert not _fusable([{"params": [cpu, torch.zeros(2, dtype=torch.int64)]}])
    assert not _fusable([{"params": []}])


@pytest.mark.cuda
def test_gpu_adam_is_fused_and_steps_as_the_foreach_path():
    """On a GPU torch's default is the foreach path (~6 passes); ours is the fused kernel."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shards = [nn.Parameter(torch.randn(n, generator=g, device="cuda")) for n in (1000, 37)]
    twins = [nn.Parameter(s.detach().clone()) for s in shards]
    ours = build_optimizer(OptimizerSpec("adamw", lr=1e-2, weight_decay=0.1),
                           [{"params": shards}])
    reference = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=True)
    assert ours.defaults["fused"] is True
    for _ in range(5):
        for s, t in zip(shards, twins):
            s.grad = torch.randn(s.shape, generator=g, device="cuda")
            t.grad = s.grad.clone()
        ours.step()
        reference.step()
    for s, t in zip(shards, twins):
        assert _rel(s.detach(), t.detach()) < RTOL


def _offload_step(rank, world, offload):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    zero = build_zero([model], ZeroConfig(zero_stage=1, optimizer="adamw", lr=1e-2,
                                          offload_optimizer="cpu" if offload else "none"))
    for step in range(3):
        zero.zero_grad()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        zero.backward(model(x).square().mean())
        zero.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, \
        zero.optimizer.defaults.get("fused")


def test_offloaded_zero_step_matches_the_on_device_step():
    offloaded, fused = run_on_ranks(_offload_step, 1, True)[0]
    on_device, _ = run_on_ranks(_offload_step, 1, False)[0]
    assert fused is True
    for name, p in offloaded.items():
        assert _rel(p, on_device[name]) < RTOL, name
