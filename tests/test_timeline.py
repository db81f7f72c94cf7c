"""The merged timeline (--timeline / GIGATRON_TIMELINE): one Chrome trace for all ranks, with
a valid schema, properly nested spans, 1F1B's order on every pipeline rank (zb-h1's with B
and W as separate spans), one clock, the engine's spans, crashed runs' parts, and nothing
recorded when it is off."""
import json
import os
import re
import sys
from collections import defaultdict

import pytest

from multirank import run_on_ranks

from gigatron.parallel import timeline
from gigatron.parallel.pipeline.schedules import Backward, Forward, one_f_one_b
from gigatron.parallel.timeline_merge import Part, assign_lanes, build_trace, clock_map, \
    read_part

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --lr 1e-2 --mock-data --vocab-size 128 --hidden-dropout 0 "
         "--attention-dropout 0 --log-interval 1 --eval-iters 1 --eval-interval 2 "
         "--no-progress --make-vocab-size-divisible-by 8").split()
EPS = 1e-6  # µs: ts and ends are rounded to the ns


def _pretrain(rank, world, argv):
    import contextlib
    import io

    from gigatron.training.run import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pretrain.main(argv)
    return code, out.getvalue(), timeline.on, timeline._rec is None


def _load(path):
    with open(path) as f:
        return json.load(f)


def _spans(trace):
    """{(pid, tid): [X events sorted by start, longest first]}"""
    rows = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            rows[(e["pid"], e["tid"])].append(e)
    for spans in rows.values():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
    return rows


def _names(trace, kind):
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
            if e["ph"] == "M" and e["name"] == f"{kind}_name"}


def _check_schema(trace, world):
    for e in trace["traceEvents"]:
        assert {"name", "ph", "ts", "pid", "tid"} <= set(e), e
        assert e["ph"] in ("X", "M"), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
    processes = {pid: name for (pid, _), name in _names(trace, "process").items()}
    assert sorted(processes) == list(range(world))
    for pid, name in processes.items():
        assert re.fullmatch(rf"rank {pid} \(tp \d, pp \d, dp \d\)", name), name
    threads = _names(trace, "thread")
    assert all(key in threads for key in _spans(trace)), "every row is named"


def _check_nesting(trace):
    """Within one row, two spans are disjoint or one contains the other."""
    for row, spans in _spans(trace).items():
        stack = []
        for e in spans:
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"] + EPS:
                stack.pop()
            assert not stack or end <= stack[-1] + EPS, f"partial overlap on {row}: {e}"
            stack.append(end)


def _compute_order(spans):
    """[(kind, microbatch)] of each iteration's forwards/backwards, in time order."""
    steps = [e for e in spans if e["name"].startswith("iteration ")]
    order = []
    for step in steps:
        inside = [e for e in spans if e["name"].split(" ")[0] in ("forward", "backward")
                  and step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]
                  + EPS]
        order.append([(e["name"].split(" ")[0], e["args"]["microbatch"]) for e in inside])
    return steps, order


def test_tp1_pp2_dp2_pretrain_gives_one_nested_trace_in_1f1b_order_on_one_clock(tmp_path):
    path = str(tmp_path / "trace" / "t.json")
    argv = FLAGS + ["--train-iters", "3", "--global-batch-size", "16", "--zero-stage", "1",
                    "--pipeline-model-parallel-size", "2", "--timeline", path]
    results = run_on_ranks(_pretrain, 4, argv)
    assert [r[0] for r in results] == [0] * 4, results[0][1]
    assert f"timeline: {path}" in results[0][1]
    assert all(not on and gone for _, _, on, gone in results)  # finished on every rank
    assert not os.path.exists(path + ".parts"), "merged parts are removed"
    trace = _load(path)
    _check_schema(trace, 4)
    _check_nesting(trace)
    assert trace["otherData"]["missing_ranks"] == [] == trace["otherData"]["incomplete_ranks"]
    rows, names = _spans(trace), _names(trace, "process")
    for pid in range(4):
        pp_rank = int(re.search(r"pp (\d)", names[(pid, 0)]).group(1))
        main = rows[(pid, 1)]
        steps, order = _compute_order(main)
        assert [s["name"] for s in steps] == ["iteration 1", "iteration 2", "iteration 3"]
        expected = [("forward" if isinstance(i, Forward) else "backward", i.microbatch)
                    for i in one_f_one_b(pp_rank, 2, 4) if isinstance(i, (Forward, Backward))]
        assert order == [expected] * 3, f"rank {pid} (pp {pp_rank})"
        span_names = {e["name"] for e in main}
        assert {"data", "optimizer step", "gradient reduction", "valid evaluation",
                "test evaluation"} <= span_names
        in_flight = [e for (p, tid), spans in rows.items() if p == pid and tid >= 1000
                     for e in spans]
        assert {e["name"] for e in in_flight} >= {"reduce_scatter", "all_gather"}
        assert any(e["name"].startswith("send/recv with rank") and e["args"]["bytes"] > 0
                   for e in in_flight)
        assert all("group" in e["args"] and e["args"]["bytes"] >= 0 for e in in_flight)
    _check_one_clock(rows)


def _check_one_clock(rows):
    """The n-th blocking world all-reduce of every rank overlaps all others in time: none
    can return before the last rank entered it, so on one clock max(start) <= min(end)."""
    per_rank = [[e for e in rows[(pid, 1)] if e["name"] == "all_reduce"
                 and e["args"]["group"] == "world"] for pid in range(4)]
    counts = {len(spans) for spans in per_rank}
    assert len(counts) == 1 and counts.pop() >= 3
    for calls in zip(*per_rank):
        assert max(e["ts"] for e in calls) <= min(e["ts"] + e["dur"] for e in calls) + EPS


def test_checkpoint_save_and_env_variable_turn_it_on(tmp_path, monkeypatch):
    path = str(tmp_path / "env.json")
    monkeypatch.setenv(timeline.ENV, path)  # the forked ranks inherit it, as from a launcher
    argv = FLAGS + ["--train-iters", "2", "--global-batch-size", "8", "--save",
                    str(tmp_path / "ckpt"), "--skip-train-test"]
    assert run_on_ranks(_pretrain, 2, argv)[0][0] == 0
    trace = _load(path)
    _check_schema(trace, 2)
    _check_nesting(trace)
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"checkpoint save", "iteration 2", "forward mb 0", "backward mb 1"} <= names


def test_off_records_nothing_and_costs_no_allocation(tmp_path, monkeypatch):
    monkeypatch.delenv(timeline.ENV, raising=False)

    def never(*args, **kwargs):
        raise AssertionError("the timeline recorded while off")

    def run(rank, world, argv):
        for name in ("issue", "complete", "complete_all", "record", "_span"):
            setattr(timeline, name, never)
        return _pretrain(rank, world, argv)

    argv = FLAGS + ["--train-iters", "2", "--global-batch-size", "8",
                    "--pipeline-model-parallel-size", "2"]
    results = run_on_ranks(run, 2, argv, timeout=120)
    assert [r[0] for r in results] == [0, 0], results[0][1]
    assert "timeline:" not in results[0][1]
    assert os.listdir(tmp_path) == []
    assert timeline.span("a") is timeline.span("b")  # the one shared no-op context


def _engine_run(rank, world, path, finish_collective):
    import torch
    import torch.nn.functional as F

    import gigatron

    os.environ[timeline.ENV] = path
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "steps_per_print": 1000}
    engine, *_ = gigatron.initialize(model=net, model_parameters=net.parameters(),
                                     config=config)
    for _ in range(2 * engine.gradient_accumulation_steps()):
        x = torch.randn(2, 8)
        engine.backward(F.cross_entropy(engine(x), torch.randint(0, 4, (2,))))
        engine.step()
    return timeline.finish(finish_collective)


@pytest.mark.parametrize("collective", [True, False], ids=["gathered", "from-files"])
def test_engine_records_its_micro_batches_and_steps(tmp_path, collective):
    path = str(tmp_path / "engine.json")
    written = run_on_ranks(_engine_run, 2, path, collective)
    assert written == [path, None]
    trace = _load(path)
    _check_nesting(trace)
    assert _names(trace, "process") == {(0, 0): "rank 0 (dp 0)", (1, 0): "rank 1 (dp 1)"}
    for pid in (0, 1):
        main = [e["name"] for e in _spans(trace)[(pid, 1)]]
        assert main.count("optimizer step") == 2 and main.count("gradient reduction") == 2
        assert [n for n in main if n.startswith(("forward", "backward"))][:4] == [
            "forward mb 0", "backward mb 0", "forward mb 1", "backward mb 1"]
    assert not os.path.exists(path + ".parts")


def _crash_run(rank, world, path):
    import torch

    from gigatron.parallel import comm

    timeline.start(path, f"rank {rank}")
    comm.all_reduce(torch.ones(4))
    with timeline.span("work"):
        pass
    if rank == 1:
        timeline.flush()
        return None  # dies here: the forked worker exits without finishing
    return timeline.finish(collective=False)


def test_a_crashed_rank_leaves_its_part_and_the_merge_names_it(tmp_path, monkeypatch):
    from gigatron.parallel import timeline_merge

    monkeypatch.setenv("GIGATRON_TIMELINE_WAIT_S", "0.5")
    path = str(tmp_path / "crash.json")
    run_on_ranks(_crash_run, 2, path)
    trace = _load(path)
    assert trace["otherData"]["incomplete_ranks"] == [1]
    assert os.path.exists(timeline.part_path(path, 1)), "parts are kept for a later merge"
    os.remove(path)
    assert timeline_merge.main([path]) == 0
    names = [e["name"] for e in _load(path)["traceEvents"] if e["ph"] == "X"]
    assert names.count("work") == 2 and names.count("all_reduce") == 2


def test_a_part_cut_short_mid_line_is_read_up_to_the_cut():
    text = ('{"part":1,"rank":2,"world_size":4,"host":"h","pid":1}\n{"label":"rank 2 (dp 1)"}\n'
            '{"ref":100}\n{"spans":[["main thread","forward mb 0",110,150,null]]}\n'
            '{"spans":[["main thread","backward mb 0",160,190,null],["main thr')
    part = read_part(text)
    assert (part.rank, part.label, part.refs, part.complete) == (2, "rank 2 (dp 1)", [100],
                                                                 False)
    assert part.events == [["main thread", "forward mb 0", 110, 150, None]]


def test_async_lanes_never_overlap_and_are_fewest():
    spans = [(0, 10), (2, 5), (5, 9), (6, 20), (10, 12), (21, 22)]
    lanes = assign_lanes(spans)
    assert max(lanes) + 1 == 3  # (0, 10), (2, 5)/(5, 9), (6, 20) overlap pairwise at 6..9
    for i, a in enumerate(spans):
        for j, b in enumerate(spans):
            if i < j and lanes[i] == lanes[j]:
                assert a[1] <= b[0] or b[1] <= a[0]


def test_another_host_is_mapped_through_the_barrier_references():
    rank0 = Part(0, 2, "a", refs=[1000, 5000])
    other = Part(1, 2, "b", refs=[70000, 74004])  # 1.001x rate, offset 69000
    to_rank0 = clock_map(other, other, rank0)
    assert to_rank0(70000) == 1000 and to_rank0(74004) == 5000
    assert clock_map(Part(2, 3, "a"), rank0, rank0)(123) == 123  # same host: same clock
    trace = build_trace([Part(0, 2, "a", refs=[1000], events=[["main thread", "x", 1000,
                                                                2000, None]]),
                         Part(1, 2, "b", refs=[9000], events=[["main thread", "x", 9000,
                                                               10000, None]])])
    starts = [e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"]
    assert starts == [0.0, 0.0]


def test_the_renderer_draws_one_iteration_of_a_trace(tmp_path):
    pytest.importorskip("matplotlib")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import render_timeline

    spans = [["main thread", "iteration 1", 0, 900, None],
             ["main thread", "forward mb 0", 100, 300, {"microbatch": 0}],
             ["main thread", "backward mb 0", 400, 800, {"microbatch": 0}],
             [timeline.ASYNC, "send/recv with rank 1", 300, 450, {"bytes": 8, "group": "pp"}]]
    trace = build_trace([Part(0, 1, "h", label="rank 0 (tp 0, pp 0, dp 0)", events=spans)])
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    png = tmp_path / "t.png"
    assert render_timeline.main([str(path), str(png), "--iteration", "1"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="no 'iteration 7'"):
        render_timeline.main([str(path), str(png), "--iteration", "7"])


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_zb_h1_pp2_trace_shows_b_and_w_as_separate_spans_per_stage(tmp_path):
    from gigatron.parallel.pipeline.schedules import WeightGrad
    from gigatron.parallel.pipeline.zero_bubble import zb_h1

    path = str(tmp_path / "t.json")
    argv = FLAGS + ["--train-iters", "2", "--global-batch-size", "8", "--eval-iters", "0",
                    "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                    "--timeline", path]
    results = run_on_ranks(_pretrain, 2, argv)
    assert [r[0] for r in results] == [0, 0], results[0][1]
    trace = _load(path)
    _check_schema(trace, 2)
    _check_nesting(trace)
    rows, names = _spans(trace), _names(trace, "process")
    kinds = {Forward: "forward", Backward: "backward", WeightGrad: "weight"}
    for pid in range(2):
        pp_rank = int(re.search(r"pp (\d)", names[(pid, 0)]).group(1))
        main = rows[(pid, 1)]
        steps = [e for e in main if e["name"].startswith("iteration ")]
        assert len(steps) == 2
        expected = [(kinds[type(i)], i.microbatch) for i in zb_h1(pp_rank, 2, 4)
                    if type(i) in kinds]
        assert sum(k == "weight" for k, _ in expected) == 4
        for step in steps:
            inside = [e for e in main if e["name"].split(" ")[0] in kinds.values()
                      and step["ts"] <= e["ts"] <= step["ts"] + step["dur"]]
            assert [(e["name"].split(" ")[0], e["args"]["microbatch"]) for e in inside] == \
                expected, f"rank {pid} (pp {pp_rank})"
            b = [e for e in inside if e["name"].startswith("backward")]
            w = [e for e in inside if e["name"].startswith("weight grad")]
            assert all(x["ts"] + x["dur"] <= y["ts"] + EPS or y["ts"] + y["dur"] <= x["ts"] +
                       EPS for x in b for y in w), "B and W are disjoint spans"
            assert all(e["args"]["stage"] == pp_rank for e in b + w)
