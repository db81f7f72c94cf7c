"""--log-straggler: each log line shows the slowest and fastest ranks and names the slowest.

A rank made slower on purpose (a sleep before each forward of its model chunk) must be the
one named, by one all-gather per log line; its peers spend the same time waiting (in the
pipeline's transfers and the gradient sync), which does not count as their work.
"""
import json
import time

import pytest

from gigatron.training.observe.straggler import format_line, rank_step_ms, report
from gigatron.training.run import loop, pretrain
from multirank import run_on_ranks
from test_stuck_data_loader import imported_before_forking  # noqa: F401 (autouse fixture)


def test_the_k_slowest_and_fastest_ranks_in_order():
    r = report([10.0, 30.0, 20.0, 30.0, 5.0], 2)
    assert r.slowest == [(3, 30.0), (1, 30.0)] and r.fastest == [(4, 5.0), (0, 10.0)]
    assert report([1.0, 2.0], 5).slowest == [(1, 2.0), (0, 1.0)]  # K beyond the world
    assert rank_step_ms(elapsed_s=1.0, waited_s=0.4, steps=2) == pytest.approx(300.0)


def test_the_line_has_megatrons_min_max_shape_and_names_the_slowest():
    line = format_line(report([100.0, 150.0, 110.0], 2).fields())
    assert line == (" straggler | MnRtt/Rnk: 100.0ms/0 | MxRtt/Rnk: 150.0ms/1 | slowest: "
                    "150.0ms/1, 110.0ms/2 | fastest: 100.0ms/0, 110.0ms/2 | slowest rank 1 "
                    "works 1.50x the fastest's time per step |")


SLOW_RANK, SLEEP_S = 3, 0.05
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 128 "
         "--eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 --num-workers 0 "
         "--train-iters 4 --log-interval 2 --pipeline-model-parallel-size 2 "
         "--log-straggler --straggler-minmax-count 2").split()


def _train_with_a_slow_rank(rank, world, metrics):
    real_train = loop.train

    def train(session, progress):
        if rank == SLOW_RANK:  # every forward of this rank's chunk starts late
            for chunk in session.chunks:
                chunk.register_forward_pre_hook(lambda *_: time.sleep(SLEEP_S))
        return real_train(session, progress)

    loop.train = train
    return pretrain.main(FLAGS + ["--metrics-file", metrics])


def test_a_rank_that_sleeps_is_named_the_slowest_on_every_log_line(tmp_path, capfd):
    metrics = str(tmp_path / "metrics.jsonl")
    assert run_on_ranks(_train_with_a_slow_rank, 4, metrics, timeout=120) == [0] * 4
    out = capfd.readouterr().out
    with open(metrics) as f:
        reports = [r["straggler"] for r in map(json.loads, f) if r["type"] == "train"]
    assert len(reports) == 2, reports
    for r in reports:
        (slowest, slow_ms), (_, fast_ms) = r["slowest"][0], r["fastest"][0]
        # 2 micro-batches per step (8 / (2 x dp 2)), each forward SLEEP_S late on the slow
        # rank only; its peers wait for it, which is not their work
        assert slowest == SLOW_RANK and slow_ms - fast_ms > 0.5 * 2 * 1000 * SLEEP_S, r
        assert len(r["slowest"]) == len(r["fastest"]) == 2
    lines = [line for line in out.splitlines() if line.startswith(" straggler |")]
    assert len(lines) == 2 and all(f"slowest rank {SLOW_RANK} works " in l for l in lines), out
    assert f"MxRtt/Rnk: {reports[0]['slowest'][0][1]:.1f}ms/{SLOW_RANK} |" in lines[0], lines[0]
