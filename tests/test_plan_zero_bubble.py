"""`gigatron plan` models the zero-bubble schedules: bubble, memory and --search (issue 29).

Hand numbers at p = 4 stages, m = 8 micro-batches, F = 1 and a backward of 2 (split into
B = W = 1): 1F1B's step is (m + p - 1) x 3 = 33, bubble over busy time (p - 1) / m = 3/8;
ZB-H1's step is 3m + p - 1 = 27 (idle share (p - 1) / (3m + p - 1) = 1/9, over busy time
(p - 1) / 3m = 1/8); ZBV, two half-size chunks per stage, simulates to 25.5 (1/16). ZB-H1's
stage r holds 1F1B's p - r micro-batches of activations plus r W stashes (the deferred
linears' inputs and output gradients, held from B to W); ZBV holds 8 chunk forwards (4
stages' worth) on every stage, split over its two chunks.
"""
import json

import pytest

from gigatron.cli import plan as plan_cli
from gigatron.training.plan.cost import _schedule
from gigatron.training.plan.search import Layout, schedules

P, M = 4, 8
SMALL = ("--num-gpus 4 --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 256 "
         "--num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
         "--vocab-size 1000 --micro-batch-size 1 --global-batch-size 8 --bf16 --lr 1e-4 "
         "--train-iters 1 --mock-data --gpu h100-sxm").split()
ZBV = ("--pipeline-schedule zbv --num-layers-per-virtual-pipeline-stage 1 "
       "--untie-embeddings-and-output-weights").split()


def _plan(capsys, *argv):
    assert plan_cli.main(["--json", *SMALL, *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("schedule,v,makespan,bubble", [
    ("1f1b", 1, 33.0, 3 / 8), ("zb-h1", 1, 3 * M + P - 1, (P - 1) / (3 * M)),
    ("zbv", 2, 25.5, 1 / 16)])
def test_schedule_cost_is_the_simulators_at_p4_m8(schedule, v, makespan, bubble):
    assert _schedule(P, M, v, 1.0 / v, 2.0 / v, schedule) == pytest.approx((makespan, bubble))
    idle_share = 1 - M * 3.0 / makespan
    if schedule == "zb-h1":
        assert idle_share == pytest.approx((P - 1) / (3 * M + P - 1))


def test_plan_of_each_schedule_bubble_and_in_flight(capsys):
    base, h1, v = _plan(capsys), _plan(capsys, "--pipeline-schedule", "zb-h1"), \
        _plan(capsys, *ZBV)
    assert "pipeline_schedule" not in base["layout"]
    assert h1["layout"]["pipeline_schedule"] == "zb-h1"
    assert v["layout"]["pipeline_schedule"] == "zbv" and v["layout"]["virtual_chunks"] == 2
    assert [s["microbatches_in_flight"] for s in base["stages"]] == [[4], [3], [2], [1]]
    assert [s["microbatches_in_flight"] for s in h1["stages"]] == [[4], [3], [2], [1]]
    assert [s.get("w_stash_in_flight") for s in h1["stages"]] == [None, [1], [2], [3]]
    assert [s["microbatches_in_flight"] for s in v["stages"]] == [[7, 1], [6, 2], [5, 3],
                                                                  [4, 4]]
    # the middle stages' layers are alike: zb-h1 holds 1F1B's 3 there and one W stash, a
    # little less than a fourth micro-batch's activations (32sbh against 34sbh + ...)
    one, two = base["stages"][1]["bytes"]["activations"], h1["stages"][1]["bytes"]["activations"]
    assert one * (1 + 0.8 / 3) < two < one * 4 / 3
    assert h1["step"]["bubble"] < base["step"]["bubble"] / 2
    # ZBV below ZB-H1 (a quarter of 1F1B's at F:B = 1:2; this tiny model's backward is
    # nearer 3F: gemm.py's 48 backward kernels' gaps against 16 forward)
    assert v["step"]["bubble"] < min(h1["step"]["bubble"], base["step"]["bubble"] / 3)
    assert h1["step"]["pipeline_s"] < base["step"]["pipeline_s"]


def test_text_report_names_the_schedule(capsys):
    assert plan_cli.main([*SMALL, "--pipeline-schedule", "zb-h1"]) == 0
    assert "micro-batches, schedule ZB-H1" in capsys.readouterr().out


def test_search_considers_zbv_only_where_valid():
    assert schedules(1, 8, 0, tied_embeddings=False) == ["1f1b"]
    assert schedules(4, 8, 3, tied_embeddings=False) == ["1f1b"]
    assert schedules(4, 8, 2, tied_embeddings=True) == ["1f1b", "zb-h1"]
    assert schedules(4, 12, 1, tied_embeddings=False) == ["1f1b", "zb-h1"]
    assert schedules(4, 8, 1, tied_embeddings=False) == ["1f1b", "zb-h1", "zbv"]
    assert Layout(1, 4, 1, 0, "none", 1).describe().endswith("mbs=1")


def test_search_ranks_zero_bubble_layouts(capsys):
    at = SMALL.index("--pipeline-model-parallel-size")
    argv = SMALL[:at] + SMALL[at + 2:]
    assert plan_cli.main(["--search", "--json", "--untie-embeddings-and-output-weights",
                          *argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert not [r for r in doc["refused"] if "--pipeline-schedule" in r["reason"]]
    steps = {}
    for plan in doc["ranked"]:
        lay = plan["layout"]
        name = lay.get("pipeline_schedule", "1f1b")
        assert name == "1f1b" or (lay["pp"] > 1 and lay["zero_stage"] < 3)
        assert lay["virtual_chunks"] == (2 if name == "zbv" else 1)
        if (lay["pp"], lay["zero_stage"], lay["recompute"], lay["micro_batch_size"]) == \
                (4, 1, "none", 1):
            steps[name] = plan["step"]["pipeline_s"]
    assert set(steps) == {"1f1b", "zb-h1", "zbv"}
    assert max(steps["zbv"], steps["zb-h1"]) < steps["1f1b"]
