"""gigatron plan's speed model: the pipeline-bubble formulas exactly, and the Megatron-LM
SC21 paper's weak-scaling table (Narayanan et al. 2021, Table 1: 1.7B to 1T parameters on
32 to 3072 A100s) within +-15% per row, with the same measured constants for every row
(training/plan/cost.py, gemm.py; the A100's matmul ceiling and SMs from devices.py)."""
import pytest

from gigatron.parallel.pipeline.schedules import build_schedule
from gigatron.parallel.pipeline.simulate import bubble_overhead, peak_in_flight
from gigatron.training.plan.sc21 import TABLE_1, megatron_sc21_flops, predict


@pytest.mark.parametrize("p,m", [(2, 2), (4, 8), (8, 16), (8, 64), (5, 7)])
def test_1f1b_bubble_is_p_minus_1_over_m(p, m):
    assert bubble_overhead(p, m) == (p - 1) / m


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (8, 16, 3)])
def test_interleaved_bubble_is_p_minus_1_over_v_m(p, m, v):
    assert bubble_overhead(p, m, v) == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (8, 16, 1), (4, 8, 2), (8, 16, 4)])
def test_first_stage_holds_megatrons_in_flight_count(p, m, v):
    _, held, _ = peak_in_flight(build_schedule(0, p, m, v), [1.0] * v)
    expected = p if v == 1 else (p - 1) * 2 + (v - 1) * p + 1  # Megatron's warm-up + 1
    assert sum(held) == expected


def test_sc21_flop_formula_matches_the_papers_own_numbers():
    # 1T row: 502 PFLOP/s aggregate at 163 TFLOP/s per GPU on 3072 GPUs (Table 1)
    flops = megatron_sc21_flops(3072, 2048, 128, 25600, 51200)
    assert flops == pytest.approx(96 * 3072 * 2048 * 128 * 25600 ** 2 *
                                  (1 + 2048 / (6 * 25600) + 51200 / (16 * 128 * 25600)))


@pytest.mark.parametrize("row", TABLE_1, ids=[f"{r.billions}B" for r in TABLE_1])
def test_sc21_table_row_within_15_percent(row):
    plan, tflops = predict(row)
    assert plan.fits
    assert abs(tflops / row.tflops_per_gpu - 1) <= 0.15, (row, tflops)
    p, m = row.pp, row.batch // (row.gpus // (row.tp * row.pp))
    assert plan.cost.bubble == pytest.approx((p - 1) / m, abs=1e-9)  # the schedule's own

