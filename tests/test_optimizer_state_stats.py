"""--log-optimizer-states-to-tensorboard: the optimizer-state norms of a tp=2 x dp=2 run (ZeRO
stages 0, 1 and 3) equal the norms of single-device torch.optim.AdamW's state after the same
steps, each element of the model counted once (a tp-replicated LayerNorm counted twice would
move weight_l2 by ~10%: the norm weights are ones among small random weights).

Tolerance: 1e-4 relative for the L2 and L1 norms, 1e-3 for the largest |value|; the moments
differ from the single-device ones only by the order of the tp/dp sums (test_zero_gpt.py
bounds the parameters at 1e-5)."""
import pytest
import torch

from multirank import run_on_ranks
from test_zero_gpt import BATCH, LR, SEED, WD, gpt_batches, gpt_config
from zero_models import torch_param_groups

from gigatron.models.gpt import GPTModel
from gigatron.parallel.zero import ZeroConfig, build_zero
from gigatron.parallel.zero.state_stats import optimizer_state_stats

STEPS = 2


def reference_stats():
    model = GPTModel(gpt_config(), seed=SEED)
    opt = torch.optim.AdamW(torch_param_groups(model, WD), lr=LR)
    for tokens, labels in gpt_batches(STEPS):
        opt.zero_grad()
        model(input_ids=tokens, labels=labels).mean().backward()
        opt.step()
    series = {"variance": [], "variance_sqrt": [], "momentum": [], "weight": []}
    for p in model.parameters():
        st = opt.state[p]
        series["variance"].append(st["exp_avg_sq"].double().flatten())
        series["variance_sqrt"].append(st["exp_avg_sq"].double().sqrt().flatten())
        series["momentum"].append(st["exp_avg"].double().flatten())
        series["weight"].append(p.detach().double().flatten())
    out = {}
    for name, parts in series.items():
        x = torch.cat(parts)
        out[f"{name}_l2"] = x.norm().item()
        out[f"{name}_l1"] = x.abs().sum().item()
        out[f"{name}_abs_max"] = x.abs().max().item()
    return out


def _tp2_dp2(rank, world, stages):
    from gigatron.parallel.topology import ProcessGroups, Topology
    groups = ProcessGroups(Topology(tp=2, dp=2), rank)
    dp_rank, per, out = groups.index("dp"), BATCH // 2, {}
    for stage in stages:
        model = GPTModel(gpt_config(), tp_group=groups.tp, seed=SEED)
        zero = build_zero(model, ZeroConfig(zero_stage=stage, lr=LR, weight_decay=WD,
                                            reduce_bucket_size=2000), groups)
        for tokens, labels in gpt_batches(STEPS):
            tokens, labels = (x[dp_rank * per:(dp_rank + 1) * per] for x in (tokens, labels))
            zero.zero_grad()
            zero.backward(model(input_ids=tokens, labels=labels).mean())
            assert zero.step().success
        out[stage] = optimizer_state_stats(zero)
    return out


def test_state_norms_of_every_zero_stage_equal_single_device_adamw():
    want = reference_stats()
    stages = (0, 1, 3)
    for rank_result in run_on_ranks(_tp2_dp2, 4, stages, timeout=180):
        for stage in stages:
            got = rank_result[stage]
            assert set(got) == set(want)
            for key, value in want.items():
                rel = 1e-3 if key.endswith("abs_max") else 1e-4
                assert got[key] == pytest.approx(value, rel=rel), (stage, key)


def test_one_process_without_moments_reports_the_weights_only():
    model = GPTModel(gpt_config(), seed=SEED)
    zero = build_zero(model, ZeroConfig(zero_stage=0, lr=LR, optimizer="sgd"))
    stats = optimizer_state_stats(zero)
    weights = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    assert set(stats) == {"weight_l2", "weight_l1", "weight_abs_max"}
    assert stats["weight_l2"] == pytest.approx(weights.norm().item(), rel=1e-12)
