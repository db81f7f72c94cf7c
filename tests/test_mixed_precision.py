"""Mixed precision: bf16 params with fp32 masters match a single-device bf16 reference;
fp16 dynamic loss scaling follows DeepSpeed's documented semantics; an overflow on one rank
skips the step on every rank."""
import torch

from multirank import run_on_ranks
from test_zero import BATCH, LR, STEPS, WD, full_params, train
from zero_models import TinyLM, batches, reference_mixed_precision

from gigatron.parallel.zero import DynamicLossScaler, LossScaler, ZeroConfig, build_zero

def _bf16_stages(rank, world):
    out = {}
    for stage in range(4):
        model = TinyLM(dtype=torch.bfloat16)
        model, zero, log = train(rank, world, stage, 1, model=model)
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert all(g.master.dtype == torch.float32 for g in zero.flat_groups)
        out[stage] = full_params(model, zero)
    return out


def test_bf16_params_with_fp32_masters_match_single_device_mixed_precision():
    ref = reference_mixed_precision(STEPS, BATCH, torch.bfloat16, LR, WD)
    results = run_on_ranks(_bf16_stages, 2)
    for r in range(2):
        for stage, params in results[r].items():
            for name, want in ref.items():
                # The dp sum of two half-batch bf16 grads rounds differently from one
                # full-batch bf16 grad (~3 significant digits); Adam's updates are ~lr whatever
                # the grad size, so a near-zero grad element can differ by a fraction of lr per
                # step: tolerance 0.25 lr per step (bf16 vs fp32 references differ by ~2x that).
                err = (params[name].float() - want.float()).abs().max().item()
                assert err <= 0.25 * LR * STEPS, f"stage {stage} {name}: {err:.3g}"
                # every stage does the same arithmetic on the same reduced grads
                assert torch.equal(params[name], results[r][0][name]), (stage, name)


# (overflow injected?, expected skipped, expected scale after the step) for
# initial_scale_power=8, loss_scale_window=3, hysteresis=2 — DeepSpeed's rules: an overflow
# with hysteresis left only decrements it; the scale halves when hysteresis is exhausted; it
# doubles (refilling hysteresis) every `window` clean steps counted from the last overflow.
SCHEDULE = [
    (False, False, 256), (True, True, 256), (False, False, 256), (True, True, 128),
    (True, True, 64), (False, False, 64), (False, False, 64), (False, False, 128),
    (True, True, 128), (True, True, 64), (False, False, 64),
]


def test_dynamic_loss_scaler_follows_deepspeed_hysteresis_and_window():
    scaler = DynamicLossScaler(initial_scale_power=8, loss_scale_window=3, hysteresis=2)
    for overflow, _, scale in SCHEDULE:
        scaler.update(overflow)
        assert scaler.scale == scale


def test_dynamic_loss_scaler_grows_after_window_clean_steps_and_respects_min():
    scaler = DynamicLossScaler(initial_scale_power=16, loss_scale_window=1000)
    assert scaler.scale == 2 ** 16  # DeepSpeed's defaults: 2**16, window 1000, hysteresis 2
    for _ in range(999):
        scaler.update(False)
    assert scaler.scale == 2 ** 16
    scaler.update(False)
    assert scaler.scale == 2 ** 17
    low = DynamicLossScaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    for _ in range(3):
        low.update(True)
    assert low.scale == 1.0


def test_consecutive_hysteresis_refills_on_every_clean_step():
    plain = DynamicLossScaler(initial_scale_power=8, loss_scale_window=100, hysteresis=2)
    refill = DynamicLossScaler(initial_scale_power=8, loss_scale_window=100, hysteresis=2,
                               consecutive_hysteresis=True)
    for overflow in (True, False, True):
        plain.update(overflow)
        refill.update(overflow)
    assert (plain.scale, refill.scale) == (128, 256)


def test_scaler_state_dict_round_trips():
    a = DynamicLossScaler(initial_scale_power=8, loss_scale_window=3)
    for overflow, _, _ in SCHEDULE[:5]:
        a.update(overflow)
    b = DynamicLossScaler(initial_scale_power=8, loss_scale_window=3)
    b.load_state_dict(a.state_dict())
    for overflow, _, _ in SCHEDULE[5:]:
        a.update(overflow)
        b.update(overflow)
        assert a.scale == b.scale
    static = LossScaler(4.0)
    static.update(True)
    assert static.scale == 4.0


def _fp16_overflow(rank, world):
    model = TinyLM(dtype=torch.float16)
    zero = build_zero(model, ZeroConfig(zero_stage=1, lr=LR, initial_scale_power=8,
                                        loss_scale_window=3, hysteresis=2))
    per, log = BATCH // world, []
    for step, (tokens, labels) in enumerate(batches(len(SCHEDULE), BATCH)):
        zero.zero_grad()
        loss = model(tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per])
        zero.backward(loss.mean())
        zero.finish_sync()
        if SCHEDULE[step][0] and rank == 0:  # an inf in rank 0's gradient shard only
            zero.flat_groups[0].shard_views[0][0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        result = zero.step()
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        log.append((result.skipped, zero.loss_scale, unchanged, result.loss_scale))
    static = build_zero(TinyLM(dtype=torch.float16), ZeroConfig(zero_stage=1, loss_scale=128))
    return log, zero.skipped_steps, static.loss_scale


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank_and_scale_follows_deepspeed():
    results = run_on_ranks(_fp16_overflow, 2)
    for log, skipped, static_scale in results:
        assert skipped == sum(1 for o, _, _ in SCHEDULE if o)
        assert static_scale == 128
        for (skip, scale, unchanged, used), (_, want_skip, want_scale) in zip(log, SCHEDULE):
            assert skip == want_skip and scale == want_scale
            assert unchanged == want_skip  # a skipped step leaves params alone, others move
        assert log[0][3] == 256  # the step ran with the scale before its update
