"""DeepSpeed's lr schedulers give DeepSpeed's values at every step, on every param group.

Expected values are written out by hand from DeepSpeed's formulas (step = last_batch_iteration:
-1 after construction, then 0, 1, ...), at the key points of each schedule.
"""
import math

import pytest
import torch

from gigatron.training.config.deepspeed.engine_config import SchedulerSpec
from gigatron.training.lr.formulas import (
    lr_range_test_lr, one_cycle_lr, one_cycle_momentum, one_cycle_scale, warmup_cosine_lr,
    warmup_decay_lr, warmup_lr)
from gigatron.training.lr.deepspeed import (
    LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR, build_scheduler,
    scheduler_params)

LOG5 = math.log(5) / math.log(10)  # log warm-up's gamma at step 4 of 10


def make_optimizer(kind="adam", lr=0.2, groups=1):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    param_groups = [{"params": [p]} for p in params]
    if kind == "sgd":
        return torch.optim.SGD(param_groups, lr=lr, momentum=0.9)
    if kind == "adagrad":
        return torch.optim.Adagrad(param_groups, lr=lr)
    return torch.optim.Adam(param_groups, lr=lr, betas=(0.9, 0.999))


def lr_at(scheduler, step):
    scheduler.step(step)
    lrs = [g["lr"] for g in scheduler.optimizer.param_groups]
    assert scheduler.get_last_lr() == lrs
    return lrs[0]


def check_steps(scheduler, expected):
    """`expected` maps step -> lr; step -1 is the lr the constructor set."""
    for step, lr in expected.items():
        got = scheduler.optimizer.param_groups[0]["lr"] if step == -1 else lr_at(scheduler, step)
        assert got == pytest.approx(lr, rel=1e-12, abs=1e-15), f"step {step}"


# ---- WarmupLR --------------------------------------------------------------------------
WARMUP_LR = {
    "log": {-1: 0.0, 0: 0.0, 4: 0.1 * LOG5, 9: 0.1, 10: 0.1, 100: 0.1},
    "linear": {-1: 0.0, 0: 0.0, 5: 0.05, 9: 0.09, 10: 0.1, 100: 0.1},
}


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_lr_warms_up_then_holds_max(warmup_type):
    s = WarmupLR(make_optimizer(), warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10,
                 warmup_type=warmup_type)
    check_steps(s, WARMUP_LR[warmup_type])
    for step, lr in WARMUP_LR[warmup_type].items():
        assert warmup_lr(step, 0.0, 0.1, 10, warmup_type) == pytest.approx(lr, rel=1e-12)


def test_warmup_lr_defaults_are_deepspeeds():
    s = WarmupLR(make_optimizer(lr=0.3))
    assert (s.min_lrs, s.max_lrs, s.warmup_num_steps, s.warmup_type) == ([0.0], [0.3], 1000, "log")
    assert lr_at(s, 999) == pytest.approx(0.3)
    assert warmup_lr(999) == pytest.approx(0.001)  # the pure function's max is 0.001


def test_warmup_of_one_step_lasts_two_like_deepspeed():
    assert warmup_lr(1, 0.0, 1.0, warmup_num_steps=1, warmup_type="linear") == 0.5
    assert warmup_lr(1, 0.0, 1.0, warmup_num_steps=1, warmup_type="log") == 1.0
    assert warmup_lr(2, 0.0, 1.0, warmup_num_steps=1, warmup_type="linear") == 1.0


def test_warmup_lr_sets_every_group_from_per_group_lists():
    opt = make_optimizer(groups=2)
    s = WarmupLR(opt, warmup_min_lr=[0.0, 0.01], warmup_max_lr=[0.1, 0.02], warmup_num_steps=10,
                 warmup_type="linear")
    s.step(5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.05, 0.015])
    default_max = WarmupLR(make_optimizer(groups=2), warmup_num_steps=10)
    assert default_max.max_lrs == [0.2, 0.2]


# ---- WarmupDecayLR ---------------------------------------------------------------------
WARMUP_DECAY_LR = {  # min 0.01, max 0.1, W 10, T 30
    "log": {-1: 0.01, 0: 0.01, 4: 0.01 + 0.09 * LOG5, 9: 0.1, 10: 0.1, 20: 0.055, 30: 0.01,
            40: 0.01},
    "linear": {-1: 0.01, 0: 0.01, 5: 0.055, 9: 0.091, 10: 0.1, 15: 0.0775, 20: 0.055,
               30: 0.01, 40: 0.01},
}


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_decay_lr_decays_linearly_to_min_at_total_num_steps(warmup_type):
    s = WarmupDecayLR(make_optimizer(), total_num_steps=30, warmup_min_lr=0.01,
                      warmup_max_lr=0.1, warmup_num_steps=10, warmup_type=warmup_type)
    check_steps(s, WARMUP_DECAY_LR[warmup_type])
    for step, lr in WARMUP_DECAY_LR[warmup_type].items():
        assert warmup_decay_lr(step, 30, 0.01, 0.1, 10, warmup_type) == pytest.approx(lr)


def test_warmup_decay_lr_defaults_ignore_the_optimizer_lr():
    s = WarmupDecayLR(make_optimizer(lr=0.5), total_num_steps=5000)
    assert (s.min_lrs, s.max_lrs, s.warmup_num_steps) == ([0.0], [0.001], 1000)


def test_total_shorter_than_warmup_warns():
    with pytest.warns(UserWarning, match="total_num_steps 5 is less than warmup_num_steps 10"):
        WarmupDecayLR(make_optimizer(), total_num_steps=5, warmup_num_steps=10)
    with pytest.warns(UserWarning, match="less than warmup_num_steps"):
        WarmupCosineLR(make_optimizer(), total_num_steps=5, warmup_num_steps=10)


# ---- WarmupCosineLR --------------------------------------------------------------------
def cosine_ratio(progress):
    return 0.05 + 0.95 * (1 + math.cos(math.pi * progress)) / 2


WARMUP_COSINE_LR = {  # base lr 0.2, T 30, W 10, warmup_min_ratio 0.1, cos_min_ratio 0.05
    "log": {-1: 0.0, 0: 0.02, 4: 0.2 * (0.1 + 0.9 * LOG5), 9: 0.2, 10: 0.2 * cosine_ratio(0.05),
            19: 0.105, 29: 0.01, 50: 0.01},
    "linear": {-1: 0.0, 0: 0.02, 5: 0.11, 9: 0.182, 10: 0.2 * cosine_ratio(0.05), 19: 0.105,
               29: 0.01, 50: 0.01},
}


@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_warmup_cosine_lr_scales_the_group_lr_down_to_cos_min_ratio(warmup_type):
    s = WarmupCosineLR(make_optimizer(lr=0.2), total_num_steps=30, warmup_min_ratio=0.1,
                       warmup_num_steps=10, cos_min_ratio=0.05, warmup_type=warmup_type)
    check_steps(s, WARMUP_COSINE_LR[warmup_type])
    for step, lr in WARMUP_COSINE_LR[warmup_type].items():
        assert warmup_cosine_lr(step, 0.2, 30, 0.1, 10, 0.05, warmup_type) == pytest.approx(lr)


def test_warmup_cosine_lr_keeps_each_groups_own_lr():
    opt = make_optimizer(groups=2)
    opt.param_groups[1]["lr"] = 0.4
    s = WarmupCosineLR(opt, total_num_steps=30, warmup_num_steps=10, warmup_type="linear")
    s.step(5)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.1, 0.2])
    assert (s.warmup_min_ratio, s.cos_min_ratio) == (0.0, 0.0001)


# ---- OneCycle --------------------------------------------------------------------------
ONE_CYCLE = dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                 cycle_second_step_size=6, decay_lr_rate=0.5, decay_step_size=2,
                 cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.1)
# step: (lr, momentum); the peak is at step 3 (batch 4), back at the bottom at step 9
ONE_CYCLE_VALUES = {0: (0.0325, 0.875), 2: (0.0775, 0.825), 3: (0.1, 0.8), 6: (0.055, 0.85),
                    8: (0.025, 0.9 - 0.1 / 6), 9: (0.01, 0.9), 10: (0.008, 0.945),
                    13: (0.005, 1.08)}


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_one_cycle_cycles_lr_and_momentum_then_decays(kind):
    opt = make_optimizer(kind)
    s = OneCycle(opt, **ONE_CYCLE)
    group = opt.param_groups[0]
    momentum = (lambda: group["betas"][0]) if kind == "adam" else (lambda: group["momentum"])
    assert (group["lr"], momentum()) == (0.01, 0.8)  # the constructor sets both minimums
    for step, (lr, mom) in ONE_CYCLE_VALUES.items():
        assert lr_at(s, step) == pytest.approx(lr, rel=1e-12), step
        assert momentum() == pytest.approx(mom, rel=1e-12), step
        assert s.get_mom() == pytest.approx([mom])
        assert one_cycle_lr(step, 0.01, 0.1, 0.5, 4, 6, 0, None, 2) == pytest.approx(lr)
        assert one_cycle_momentum(step, 0.8, 0.9, 0.1, 4, 6, 0, None, 2) == pytest.approx(mom)
    if kind == "adam":
        assert group["betas"][1] == 0.999


def test_one_cycle_without_decay_stays_at_the_cycle_ends():
    s = OneCycle(make_optimizer(), 0.01, 0.1, cycle_first_step_size=4, decay_lr_rate=0.5)
    assert lr_at(s, 3) == pytest.approx(0.1)
    assert lr_at(s, 50) == 0.01  # decay_step_size 0 (the default) means no decay
    assert s.get_mom() == [0.9]


def test_one_cycle_stairs_hold_lr_flat():
    scales = [one_cycle_scale(step, 4, None, 2) for step in range(8)]
    assert scales == [0.0, 0.5, 0.5, 1.0, 0.5, 0.5, 0.0, 0.0]
    assert [one_cycle_scale(step, 4, 4, 0, 4) for step in range(4, 8)] == [0.75, 0.5, 0.25, 0.0]


def test_one_cycle_stairs_reach_the_peak_of_an_asymmetric_cycle():
    # batch 3 of a 3 + 7 cycle: 1 + 3/10 - 1 is a hair above 0.3, on the falling side
    assert one_cycle_scale(2, 3, 7, 3, 5) == 1.0
    assert one_cycle_lr(2, 0.01, 0.1, cycle_first_step_size=3, cycle_second_step_size=7,
                        cycle_first_stair_count=3, cycle_second_stair_count=5) == 0.1


def test_one_cycle_defaults_and_no_momentum_to_cycle():
    s = OneCycle(make_optimizer(), 0.01, 0.1)
    assert (s.cycle["cycle_first_step_size"], s.cycle["decay_step_size"]) == (2000, 0)
    assert (s.min_moms, s.max_moms, s.cycle_momentum) == ([0.8], [0.9], True)
    with pytest.warns(UserWarning, match="cycle_momentum is disabled"):
        s = OneCycle(make_optimizer("adagrad"), 0.01, 0.1)
    s.step()
    assert s.get_mom() is None and "betas" not in s.optimizer.param_groups[0]


# ---- LRRangeTest -----------------------------------------------------------------------
LR_RANGE_TEST = {  # min 0.01, step size 10, rate 0.5
    False: {-1: 0.01, 0: 0.0105, 4: 0.0125, 9: 0.015, 19: 0.02, 99: 0.06},
    True: {-1: 0.01, 0: 0.01, 8: 0.01, 9: 0.015, 18: 0.015, 19: 0.02, 99: 0.06},
}


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_grows_continuously_or_by_stairs(staircase):
    s = LRRangeTest(make_optimizer(), lr_range_test_min_lr=0.01, lr_range_test_step_size=10,
                    lr_range_test_step_rate=0.5, lr_range_test_staircase=staircase)
    check_steps(s, LR_RANGE_TEST[staircase])
    for step, lr in LR_RANGE_TEST[staircase].items():
        assert lr_range_test_lr(step, 0.01, 10, 0.5, staircase) == pytest.approx(lr)


# ---- all schedulers --------------------------------------------------------------------
SPECS = [
    SchedulerSpec("WarmupLR", {"warmup_num_steps": 5, "warmup_max_lr": 0.1}),
    SchedulerSpec("WarmupLR", {"warmup_num_steps": 5, "warmup_type": "linear"}),
    SchedulerSpec("WarmupDecayLR", {"total_num_steps": 20, "warmup_num_steps": 5}),
    SchedulerSpec("WarmupCosineLR", {"total_num_steps": 20, "warmup_num_steps": 5,
                                     "warmup_type": "linear"}),
    SchedulerSpec("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "decay_step_size": 3,
                               "cycle_first_step_size": 4, "decay_lr_rate": 0.2,
                               "cycle_first_stair_count": 2, "decay_mom_rate": 0.01}),
    SchedulerSpec("LRRangeTest", {"lr_range_test_step_size": 3}),
]


def trace(scheduler, steps):
    out = []
    for _ in range(steps):
        scheduler.step()
        group = scheduler.optimizer.param_groups[0]
        out.append((group["lr"], group["betas"]))
    return out


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.type)
def test_state_dict_round_trip_resumes_exactly(spec):
    first = build_scheduler(spec, make_optimizer())
    trace(first, 7)
    saved = first.state_dict()
    assert saved == {"last_batch_iteration": 6}
    resumed = build_scheduler(spec, make_optimizer())
    resumed.load_state_dict(saved)
    assert trace(resumed, 20) == trace(first, 20)
    # built to resume: the constructor leaves the optimizer's lr alone
    opt = make_optimizer(lr=0.123)
    build_scheduler(SchedulerSpec(spec.type, dict(spec.params, last_batch_iteration=6)), opt)
    assert opt.param_groups[0]["lr"] == 0.123


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.type)
def test_step_jumps_to_a_given_batch_and_works_through_a_wrapper(spec):
    class Wrapper:  # like the ZeRO optimizer: the torch optimizer is `.optimizer`
        def __init__(self):
            self.optimizer = make_optimizer(groups=2)

    walked = build_scheduler(spec, make_optimizer(groups=2))
    trace(walked, 12)
    jumped = build_scheduler(spec, Wrapper())
    jumped.step(11)
    assert jumped.get_last_lr() == walked.get_last_lr()
    assert jumped.get_lr() == walked.get_lr()


def test_tensor_lr_is_filled_in_place():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(0.2))
    lr_tensor = opt.param_groups[0]["lr"]
    s = WarmupLR(opt, warmup_num_steps=10, warmup_type="linear")
    s.step(5)
    assert opt.param_groups[0]["lr"] is lr_tensor and lr_tensor.item() == pytest.approx(0.1)


# ---- build_scheduler and validation ----------------------------------------------------
def test_build_scheduler_passes_params_by_deepspeeds_names():
    s = build_scheduler(SchedulerSpec("WarmupDecayLR", {"total_num_steps": 30,
                                                        "warmup_min_lr": 0.01,
                                                        "warmup_max_lr": 0.1,
                                                        "warmup_num_steps": 10,
                                                        "warmup_type": "linear"}),
                        make_optimizer())
    assert isinstance(s, WarmupDecayLR) and isinstance(s, WarmupLR)
    check_steps(s, WARMUP_DECAY_LR["linear"])


def test_scheduler_params_lists_deepspeeds_defaults():
    assert scheduler_params("LRRangeTest") == {
        "lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000,
        "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": False,
        "last_batch_iteration": -1}
    assert scheduler_params("WarmupDecayLR")["total_num_steps"] == "REQUIRED"
    assert scheduler_params("WarmupLR")["warmup_max_lr"] is None
    assert scheduler_params("OneCycle")["cycle_second_stair_count"] is None


def test_unknown_scheduler_type_names_the_valid_ones_and_the_nearest():
    with pytest.raises(ValueError) as err:
        build_scheduler(SchedulerSpec("WarmupCosinLR", {}), make_optimizer())
    message = str(err.value)
    assert "'WarmupCosinLR'" in message and "did you mean 'WarmupCosineLR'" in message
    assert "WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest" in message


def test_unknown_param_names_the_valid_ones_and_the_nearest():
    with pytest.raises(ValueError) as err:
        build_scheduler(SchedulerSpec("WarmupLR", {"warmup_num_step": 10}), make_optimizer())
    message = str(err.value)
    assert "'warmup_num_step'" in message and "did you mean 'warmup_num_steps'" in message
    assert "warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type" in message


def test_missing_required_param_is_named():
    with pytest.raises(ValueError, match="OneCycle needs params: cycle_min_lr, cycle_max_lr"):
        build_scheduler(SchedulerSpec("OneCycle", {}), make_optimizer())


@pytest.mark.parametrize("spec, match", [
    (SchedulerSpec("WarmupLR", {"warmup_num_steps": 0}), "warmup_num_steps must be a positive"),
    (SchedulerSpec("WarmupLR", {"warmup_num_steps": 10.0}), "warmup_num_steps must be a pos"),
    (SchedulerSpec("WarmupCosineLR", {"total_num_steps": 9, "warmup_type": "cosine"}),
     "unknown warmup_type 'cosine': valid names are log, linear"),
    (SchedulerSpec("OneCycle", {"cycle_min_lr": 0.1, "cycle_max_lr": 1,
                                "cycle_first_step_size": 0}), "cycle_first_step_size must"),
    (SchedulerSpec("LRRangeTest", {"lr_range_test_step_size": 0}), "lr_range_test_step_size"),
    (SchedulerSpec("WarmupLR", {"warmup_max_lr": [0.1, 0.2]}), "expected 1 values for warmup_"),
])
def test_bad_values_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        build_scheduler(spec, make_optimizer())


# ---- against DeepSpeed itself, where it is installed -----------------------------------
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.type)
def test_matches_deepspeed_when_installed(spec):
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours = build_scheduler(spec, make_optimizer(groups=2))
    theirs = getattr(ds, spec.type)(make_optimizer(groups=2), **spec.params)
    for _ in range(40):
        ours.step()
        theirs.step()
        assert ours.get_last_lr() == pytest.approx(theirs.get_last_lr(), rel=1e-12)
        if spec.type == "OneCycle":
            assert ours.get_mom() == pytest.approx([m[0] for m in theirs.get_mom()], rel=1e-12)
