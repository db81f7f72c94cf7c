"""`gigatron plan --search` (issue 38, items 7 and 14): the same ranking as planning every
layout in full, refusals summed up by reason, ties within the model's precision broken in
favour of fewer model-parallel ranks and less memory, progress on stderr.

The small case: 4 layers on 2 devices of 2.9 GiB (2.44 of it the CUDA context), so the
search meets every kind of outcome: layouts that fit, out-of-memory ones and ones the run's
validation refuses, over 1f1b, zb-h1 and zbv (untied embeddings).
"""
import json
from types import SimpleNamespace

import pytest

from gigatron.cli import plan as plan_cli
from gigatron.parallel.pipeline import zero_bubble
from gigatron.parallel.pipeline.simulate import peak_in_flight, simulate_step
from gigatron.training.plan import cost, planner, ranking, report
from gigatron.training.plan import schedules as plan_schedules
from gigatron.training.plan import search as plan_search

SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
         "--max-position-embeddings 512 --vocab-size 1000 --global-batch-size 8 --bf16 "
         "--untie-embeddings-and-output-weights --gpu a100-40gb --gpu-memory-gib 2.9 "
         "--num-gpus 2").split()


def _configured():
    opts, flags, run, tokenizer, world = plan_cli.configure(SMALL + ["--search"])
    return flags, world, run.train.global_batch_size, tokenizer, plan_cli._hardware(
        opts, run.logging.peak_tflops)


def _clear_caches() -> None:
    for cached in (plan_schedules.rank_schedule, plan_schedules._held_states,
                   plan_schedules._program, zero_bubble._pipeline, cost._schedule):
        cached.cache_clear()


def _exhaustive(flags, world, batch, tokenizer, hw):
    """Every layout planned in full (memory and step) with nothing cached from another
    layout, then split by whether it fits: the search before issue 38's speed-up."""
    from gigatron.training.config.arguments import build_run_config

    ranked, refused = [], []
    num_layers, experts, seq, tied = plan_search._model_sizes(flags)
    for layout in plan_search.layouts(world, num_layers, hw.gpus_per_node, experts, None,
                                      seq, tied):
        _clear_caches()
        try:
            run = build_run_config(plan_search._flags_for(flags, layout, batch), world,
                                   tokenizer)
        except ValueError as err:
            refused.append((layout, "; ".join(getattr(err, "problems", [str(err)]))))
            continue
        plan = planner.plan_run(run, hw)
        if plan.fits:
            ranked.append((layout, plan.cost.step, plan.peak_bytes))
        else:
            refused.append((layout, None))
    ranked.sort(key=lambda row: row[1])
    return ranked, refused


def test_search_ranks_exactly_as_planning_every_layout_in_full():
    """Pruning what does not fit before costing it and the shared schedules change no
    number: the same layouts fit, in the same order, with the same step and peak (exactly),
    the same top 10 after ties, and the same ones are refused for the same reasons."""
    args = _configured()
    _clear_caches()
    ranked, refused = plan_search.search(*args)
    want_ranked, want_refused = _exhaustive(*args)
    assert len(ranked) > 20 and len(refused) > 20
    assert [(c.layout, c.plan.cost.step, c.plan.peak_bytes) for c in ranked] == want_ranked
    assert [c.layout for c in refused] == [layout for layout, _ in want_refused]
    for candidate, (_, reason) in zip(refused, want_refused):
        assert candidate.reason.startswith("out of memory") if reason is None \
            else candidate.reason == reason
    assert {c.layout.schedule for c in ranked} == {"1f1b", "zb-h1", "zbv"}
    top = [c.layout for _, c in ranking.rank_with_ties(ranked)[:10]]
    by_step = {layout: step for layout, step, _ in want_ranked}
    assert top == [c.layout for _, c in ranking.rank_with_ties(
        [SimpleNamespace(layout=layout, plan=SimpleNamespace(
            cost=SimpleNamespace(step=by_step[layout]), peak_bytes=peak))
         for layout, _, peak in want_ranked])[:10]]


def test_a_layout_that_does_not_fit_is_not_costed(monkeypatch):
    costed = []
    step_cost = planner.step_cost
    monkeypatch.setattr(planner, "step_cost",
                        lambda run, *a, **k: costed.append(run) or step_cost(run, *a, **k))
    ranked, refused = plan_search.search(*_configured())
    assert len(costed) == len(ranked)
    assert any(c.reason.startswith("out of memory") for c in refused)


def test_each_zero_bubble_shape_is_placed_once_for_every_rank():
    zero_bubble._pipeline.cache_clear()
    for rank in range(4):
        zero_bubble.zbv(rank, 4, 8)
        zero_bubble.zb_h1(rank, 4, 8)
    info = zero_bubble._pipeline.cache_info()
    assert (info.misses, info.hits) == (2, 6)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zbv", 2)])
def test_cached_peak_equals_the_simulators_over_the_whole_schedule(schedule, v):
    for pp, m in ((2, 4), (4, 8), (4, 12)):
        for rank in range(pp):
            weights = [1.0 + 0.37 * k for k in range(v)]
            stash = [0.61 + 0.2 * k for k in range(v)]
            assert plan_schedules.peak_held(rank, pp, m, v, schedule, weights, stash) == \
                peak_in_flight(plan_schedules.rank_schedule(rank, pp, m, v, schedule),
                               weights, stash)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("1f1b", 2), ("zb-h1", 1), ("zbv", 2)])
def test_replayed_makespan_equals_the_simulators_to_the_bit(schedule, v):
    for pp, m in ((2, 4), (4, 8), (4, 12)):
        for forward, backward in ((1.0, 2.0), (0.0123, 0.0345), (3.3e-3, 7.1e-3)):
            assert plan_schedules.step_makespan(pp, m, v, forward, backward, schedule) == \
                simulate_step(pp, m, v, forward, backward, schedule).makespan


def _candidate(tp, pp, step, peak_gib):
    layout = plan_search.Layout(tp, pp, 8 // (tp * pp), 1, "none", 1)
    plan = SimpleNamespace(cost=SimpleNamespace(step=step), peak_bytes=peak_gib * 2 ** 30)
    return plan_search.Candidate(layout, plan)


def test_ties_within_the_models_precision_favour_fewer_ranks_then_less_memory():
    fastest = _candidate(2, 2, 1.00, 40)  # 4 model-parallel ranks
    simpler = _candidate(1, 1, 1.03, 70)  # within 5%: 1 rank, first
    smaller = _candidate(1, 1, 1.04, 50)  # the same ranks, less memory: before `simpler`
    slower = _candidate(1, 1, 1.06, 10)  # 6% slower than the fastest: its own group
    shown = ranking.rank_with_ties([slower, simpler, fastest, smaller])
    assert [c for _, c in shown] == [smaller, simpler, fastest, slower]
    assert [g for g, _ in shown] == [0, 0, 0, 1]
    assert [c for _, c in ranking.rank_with_ties([simpler, fastest], 0.0)] == \
        [fastest, simpler]
    assert ranking.TIE_TOLERANCE == 0.05


def test_text_says_how_ties_are_broken_and_sums_refusals_by_reason(capsys):
    assert plan_cli.main(SMALL + ["--search"]) == 0
    out = capsys.readouterr().out
    head, refusals = out.split("\nrefused")
    assert "steps within 5% of each other tie" in head
    assert "(the speed model's precision, docs/PLAN.md): fewer model-parallel ranks " \
        "(tp x pp x cp), then less memory, first" in head
    lines = refusals.splitlines()[1:]
    assert 2 <= len(lines) < 10  # one line per reason, not one per layout
    assert any("e.g. " in line and "out of memory: stage" in line for line in lines)
    assert any("--zero-stage 3 needs --pipeline-model-parallel-size 1" in line
               for line in lines)
    total = int(out.split(" refused;")[0].split()[-1])
    assert sum(int(line.split()[0]) for line in lines) == total
    assert plan_cli.main(SMALL + ["--search", "--verbose"]) == 0
    verbose = capsys.readouterr().out.split("\nrefused:\n")[1].splitlines()
    assert len(verbose) == total


def test_json_keeps_every_layout_fastest_first_with_its_tie_group(capsys):
    assert plan_cli.main(SMALL + ["--search", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    steps = [p["step"]["step_s"] for p in doc["ranked"]]
    assert steps == sorted(steps) and doc["tie_tolerance"] == ranking.TIE_TOLERANCE
    groups = [p["tie_group"] for p in doc["ranked"]]
    assert groups == sorted(groups) and groups[0] == 0
    assert sum(g["count"] for g in doc["refused_by_reason"]) == len(doc["refused"])


def test_a_long_search_shows_progress_on_stderr(capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "PROGRESS_EVERY_S", 0.0)
    assert plan_cli.main(SMALL + ["--search"]) == 0
    err = capsys.readouterr().err
    assert "gigatron plan --search: 1/" in err and " layouts (" in err and "ETA" in err


def test_layers_that_do_not_divide_over_the_stages_are_split_unevenly():
    """5 layers on pp 2: first 3, last 2, planned (was refused: 'does not split evenly');
    61 layers on pp 16 as Megatron-LM's DeepSeek-V3 script splits them, 3 + 14 x 4 + 2."""
    assert plan_search.uneven_split(61, 16) == (3, 2)
    assert plan_search.uneven_split(8, 4) is None
    assert plan_search.uneven_split(24, 16) == (-1, -1)  # validation refuses it, as before
    argv = ["--num-layers", "5"] + SMALL[2:] + ["--search"]
    opts, flags, run, tokenizer, world = plan_cli.configure(argv)
    hw = plan_cli._hardware(opts, run.logging.peak_tflops)
    ranked, refused = plan_search.search(flags, world, run.train.global_batch_size,
                                         tokenizer, hw)
    pipelined = [c for c in ranked if c.layout.pp == 2]
    assert pipelined and all((c.layout.first_stage_layers, c.layout.last_stage_layers) ==
                             (3, 2) for c in pipelined)
    partition = planner.partition_of(pipelined[0].plan.run)
    assert [len(partition.layer_range(r, 0)) for r in range(2)] == [3, 2]
    assert not any("does not split evenly" in (c.reason or "") for c in refused)
