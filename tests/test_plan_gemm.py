"""gigatron plan's GEMM model (training/plan/gemm.py, issue 32): tile and wave quantisation
over the device's SMs, each linear's three GEMMs, the measured matmul ceiling as the
full-wave rate, and the cross-entropy's bytes per logit in the step."""
import pytest

from gigatron.training.observe.devices import hardware, with_overrides
from gigatron.training.plan import cost, gemm


@pytest.fixture
def one_tile(monkeypatch):
    monkeypatch.setattr(gemm, "TILES", ((256, 128),))


def test_full_waves_waste_nothing(one_tile):
    assert gemm.wave_efficiency(256 * 12, 128 * 11, 132) == 1.0  # 132 tiles: one wave


def test_one_tile_past_a_wave_costs_a_whole_wave(one_tile):
    # 133 tiles on 132 SMs: two waves, 133 of 264 tile slots busy
    assert gemm.wave_efficiency(256 * 7, 128 * 19, 132) == pytest.approx(133 / 264)


def test_partial_edge_tiles_count_only_their_useful_part(one_tile):
    # 257 rows: two row tiles, the second 1/256 useful; 2 tiles on 108 SMs, one wave
    assert gemm.wave_efficiency(257, 128, 108) == pytest.approx(257 / 256 / 108)


def test_the_best_quantised_tile_is_taken():
    # 2048 x 2304 on an A100's 108 SMs: 256x128 -> 144 tiles, two waves (0.667); 128x128
    # -> 288 tiles, three waves of 108 (288/324)
    assert gemm.wave_efficiency(2048, 2304, 108) == pytest.approx(288 / 324)
    assert gemm.wave_efficiency(2048, 2304, None) == 1.0  # SM count unknown: no model


def test_linear_backward_is_dgrad_and_wgrad_at_equal_flops(one_tile):
    forward, backward = gemm.linear_efficiency(256 * 12, 128 * 19, 128 * 11, 132)
    assert forward == pytest.approx(gemm.wave_efficiency(256 * 12, 128 * 11, 132))
    dgrad = gemm.wave_efficiency(256 * 12, 128 * 19, 132)
    wgrad = gemm.wave_efficiency(128 * 19, 128 * 11, 132)
    assert backward == pytest.approx(2 / (1 / dgrad + 1 / wgrad))
    seconds = gemm.linears_seconds(((128 * 19, 128 * 11),), 256 * 12, 1e12, 132)
    flops = 2.0 * 256 * 12 * 128 * 19 * 128 * 11
    assert seconds == pytest.approx((flops / 1e12 / forward, 2 * flops / 1e12 / backward))


def test_full_wave_rate_is_the_measured_matmul_ceiling():
    h100 = hardware("h100-sxm")
    assert gemm.gemm_rate(h100, "bf16") == pytest.approx(792.1e12)
    assert gemm.gemm_rate(h100, "fp32") == pytest.approx(66.9e12 * gemm.GEMM_EFFICIENCY)
    b200 = hardware("b200")  # no measured ceiling: the fallback fraction of the peak
    assert gemm.gemm_rate(b200, "bf16") == pytest.approx(2250e12 * gemm.GEMM_EFFICIENCY)
    # a user's own peak: the datasheet device's ceiling no longer applies
    mine = with_overrides(h100, {"peak_tflops": 500.0})
    assert gemm.gemm_rate(mine, "bf16") == pytest.approx(500e12 * gemm.GEMM_EFFICIENCY)


def test_cross_entropy_bytes_grow_the_step_by_the_logits_they_move():
    from gigatron.training.plan.published import ROWS, predict

    row = next(r for r in ROWS if r.label == "GPT 1.7B")
    plan = predict(row)
    c, hw = plan.run.model, plan.hardware
    tokens, vocab = c.seq_length, c.padded_vocab_size(1)
    byte_rate = hw.hbm_gbps * 1e9 * cost.MEMORY_EFFICIENCY
    without = cost.CROSS_ENTROPY_BYTES
    try:
        cost.CROSS_ENTROPY_BYTES = (0, 0)
        lighter = predict(row)
    finally:
        cost.CROSS_ENTROPY_BYTES = without
    per_micro_batch = tokens * vocab * sum(without) / byte_rate
    assert plan.cost.step - lighter.cost.step == pytest.approx(
        plan.run.train.num_microbatches * per_micro_batch, rel=1e-6)
