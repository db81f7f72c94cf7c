"""Learning-rate schedules follow Megatron's formulas, in samples, at every step."""
import math

import pytest

from gigatron.training.config.run_config import LRScheduleConfig
from gigatron.training.lr.megatron import learning_rate, lr_for_iteration, validate_schedule

MAX, MIN = 1e-3, 1e-5


def cfg(style, warmup=100, decay=1000, **kw):
    return LRScheduleConfig(max_lr=MAX, min_lr=MIN, decay_style=style, warmup_steps=warmup,
                            decay_steps=decay, **kw)


@pytest.mark.parametrize("style", ["linear", "cosine", "constant", "inverse-square-root", "WSD"])
def test_warmup_is_linear_from_init_lr(style):
    c = cfg(style, wsd_decay_steps=200, init_lr=1e-4)
    for step in range(0, 101, 10):
        assert learning_rate(step, c) == pytest.approx(1e-4 + (MAX - 1e-4) * step / 100,
                                                       rel=1e-12)


def test_linear_decays_to_min_lr_at_decay_steps():
    c = cfg("linear")
    assert learning_rate(100, c) == pytest.approx(MAX)
    assert learning_rate(550, c) == pytest.approx(MIN + 0.5 * (MAX - MIN))
    assert learning_rate(1000, c) == pytest.approx(MIN)
    assert learning_rate(5000, c) == MIN


def test_cosine_follows_half_cosine():
    c = cfg("cosine")
    for step in (100, 325, 550, 775, 1000):
        ratio = (step - 100) / 900
        expected = MIN + 0.5 * (math.cos(math.pi * ratio) + 1) * (MAX - MIN)
        assert learning_rate(step, c) == pytest.approx(expected, rel=1e-12)
    assert learning_rate(1001, c) == MIN


def test_constant_stays_at_max_after_warmup():
    c = cfg("constant")
    assert {learning_rate(s, c) for s in (101, 500, 1000, 10 ** 6)} == {MAX}


def test_inverse_square_root_scales_with_warmup():
    c = cfg("inverse-square-root", decay=10 ** 6)
    assert learning_rate(400, c) == pytest.approx(MAX * math.sqrt(100 / 400))
    assert learning_rate(10 ** 6 - 1, c) == pytest.approx(max(MIN, MAX * math.sqrt(100 / 999999)))


@pytest.mark.parametrize("wsd_style,coeff", [
    ("linear", lambda r: 1 - r), ("cosine", lambda r: 0.5 * (math.cos(math.pi * r) + 1)),
    ("exponential", lambda r: 2 * 0.5 ** r - 1), ("minus_sqrt", lambda r: 1 - math.sqrt(r))])
def test_wsd_is_stable_then_anneals(wsd_style, coeff):
    c = cfg("WSD", wsd_decay_steps=200, wsd_decay_style=wsd_style)
    assert learning_rate(500, c) == MAX and learning_rate(800, c) == MAX
    for step in (850, 900, 1000):
        expected = MIN + coeff((step - 800) / 200) * (MAX - MIN)
        assert learning_rate(step, c) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert learning_rate(1000, c) == pytest.approx(MIN)


def test_iteration_uses_the_step_before_it():
    c = cfg("linear", warmup=16, decay=160)
    assert lr_for_iteration(1, 8, c) == 0.0  # Megatron: first warm-up iteration at init lr
    assert lr_for_iteration(3, 8, c) == pytest.approx(MAX)


def test_schedule_is_monotone_after_warmup():
    for style in ("linear", "cosine", "inverse-square-root"):
        c = cfg(style)
        lrs = [learning_rate(s, c) for s in range(100, 1200, 7)]
        assert all(a >= b for a, b in zip(lrs, lrs[1:])), style


def test_validate_rejects_unknown_style():
    with pytest.raises(ValueError, match="--lr-decay-style 'bogus' is not one of"):
        validate_schedule(cfg("bogus"))


def test_every_schedule_problem_is_reported_at_once():
    """Three independent schedule mistakes: three lines, each naming its flag."""
    import pytest

    from gigatron.training.config.arguments import parse_args

    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--vocab-size 128 --mock-data --micro-batch-size 1 --train-iters 10 --lr 1e-4 "
            "--min-lr 1e-3 --lr-warmup-iters 20 --lr-decay-style WSD").split()
    with pytest.raises(ValueError) as err:
        parse_args(argv, world_size=1)
    text = str(err.value)
    assert "--min-lr" in text and "warm-up" in text and "--lr-wsd-decay-iters" in text, text
