"""The dynamic fp16 loss scale keeps its owner's rule: gigatron.initialize's fp16 keys follow
DeepSpeed's DynamicLossScaler step for step, pretrain_gpt.py's flags Megatron-Core's
DynamicGradScaler (which grows the scale one clean step earlier for the same window). Both
references are the installed objects themselves, driven in-process by the same scripted
overflow sequences."""
import random
import types

import pytest
import torch

from gigatron.parallel.zero.loss_scaler import DynamicLossScaler, LossScaleAtMinimumError
from gigatron.training.config.arguments import build_run_config, parse_flags
from gigatron.training.config.deepspeed.engine import engine_config

ds_scaler = pytest.importorskip("deepspeed.runtime.fp16.loss_scaler")
mcore_scaler = pytest.importorskip("megatron.core.optimizer.grad_scaler")

# (initial_scale_power, window, hysteresis, min_loss_scale, consecutive_hysteresis)
SETTINGS = [(8, 1, 1, 1.0, False), (8, 2, 1, 1.0, False), (8, 3, 2, 1.0, False),
            (6, 4, 3, 2.0, False), (8, 3, 2, 1.0, True), (5, 2, 1, 4.0, True)]


def sequences(count=20, length=60):
    """Scripted overflow sequences: runs of clean steps of every length around the windows,
    single and repeated overflows."""
    rng = random.Random(31)
    out = [[False] * 12, [True] + [False] * 10, [False] * 3 + [True, True] + [False] * 9]
    for _ in range(count):
        p = rng.choice((0.1, 0.3, 0.5))
        out.append([rng.random() < p for _ in range(length)])
    return out


def deepspeed_scales(power, window, hysteresis, floor, consecutive, overflows, monkeypatch):
    """DeepSpeed's own scale after each step (None from the step it raises at its minimum)."""
    monkeypatch.setattr(ds_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 0))
    ref = ds_scaler.DynamicLossScaler(init_scale=2.0 ** power, scale_window=window,
                                      min_scale=floor, delayed_shift=hysteresis,
                                      consecutive_hysteresis=consecutive)
    scales = []
    for overflow in overflows:
        try:
            ref.update_scale(overflow)
        except Exception as err:  # DeepSpeed raises a bare Exception at its minimum
            assert "already at minimum" in str(err)
            return scales + [None]
        scales.append(ref.cur_scale)
    return scales


def gigatron_scales(overflows, **kw):
    """gigatron's scale after each step (None from the step it raises at its minimum)."""
    scaler, scales = DynamicLossScaler(**kw), []
    for overflow in overflows:
        try:
            scaler.update(overflow)
        except LossScaleAtMinimumError:
            return scales + [None]
        scales.append(scaler.scale)
    return scales


@pytest.mark.parametrize("power,window,hysteresis,floor,consecutive", SETTINGS)
def test_deepspeed_rule_gives_deepspeeds_exact_scale_sequence(power, window, hysteresis, floor,
                                                              consecutive, monkeypatch):
    for overflows in sequences():
        want = deepspeed_scales(power, window, hysteresis, floor, consecutive, overflows,
                                monkeypatch)
        got = gigatron_scales(overflows, initial_scale_power=power, loss_scale_window=window,
                              hysteresis=hysteresis, min_loss_scale=floor,
                              consecutive_hysteresis=consecutive, rule="deepspeed")
        assert got == want, overflows


class _CpuTorch(types.ModuleType):
    """torch, with the device= of torch.tensor dropped: Megatron's scaler puts its tensors on
    'cuda', this box has none."""
    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def tensor(*args, device=None, **kw):
        return torch.tensor(*args, **kw)


@pytest.mark.parametrize("power,window,hysteresis,floor,_", SETTINGS)
def test_megatron_rule_gives_megatron_cores_exact_scale_sequence(power, window, hysteresis,
                                                                 floor, _, monkeypatch):
    monkeypatch.setattr(mcore_scaler, "torch", _CpuTorch("torch"))
    for overflows in sequences():
        ref = mcore_scaler.DynamicGradScaler(  # Megatron-LM's arguments for it
            initial_scale=2.0 ** power, min_scale=floor, growth_factor=2.0, backoff_factor=0.5,
            growth_interval=window, hysteresis=hysteresis)
        want = []
        for overflow in overflows:
            ref.update(overflow)
            want.append(ref.scale.item())
        got = gigatron_scales(overflows, initial_scale_power=power, loss_scale_window=window,
                              hysteresis=hysteresis, min_loss_scale=floor, rule="megatron")
        assert got == want, overflows


def test_the_rules_differ_by_one_clean_step_for_the_same_window():
    clean = [False] * 4
    assert gigatron_scales(clean, initial_scale_power=4, loss_scale_window=3,
                           rule="megatron") == [16, 16, 32, 32]
    assert gigatron_scales(clean, initial_scale_power=4, loss_scale_window=3,
                           rule="deepspeed") == [16, 16, 16, 32]


def test_engine_config_uses_deepspeeds_rule_and_pretrain_gpt_megatrons():
    ds = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale_window": 5}}
    assert engine_config(ds, 1).zero.loss_scale_rule == "deepspeed"
    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--train-iters 10 --mock-data --vocab-size 100 --lr 1e-3 --fp16 "
             "--micro-batch-size 2 --loss-scale-window 5").split()
    zero = build_run_config(parse_flags(flags), 1).zero
    assert (zero.loss_scale_rule, zero.loss_scale_window) == ("megatron", 5)
