"""On CUDA, the first log line is followed by each pipeline stage's measured peak beside
gigatron plan's prediction: the per-stage max over the stage's ranks (checked here on forked
CPU ranks with the peak reading stubbed, since the lines are printed only on CUDA)."""
import types

from multirank import run_on_ranks

from gigatron.training.plan.report import measured_lines


def test_measured_lines_put_the_peak_beside_the_plan():
    lines = measured_lines({0: 2 * 2 ** 30, 1: 2 ** 30}, {0: 2.5 * 2 ** 30, 1: 2 ** 29})
    assert lines == [
        "memory, stage 0: planned peak 2.00 GiB, measured peak 2.50 GiB (+25%) (the "
        "allocator's max_memory_allocated)",
        "memory, stage 1: planned peak 1.00 GiB, measured peak 512.0 MiB (-50%) (the "
        "allocator's max_memory_allocated)"]


def _report(rank, world):
    import torch

    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.training.run import loop

    printed = []
    groups = ProcessGroups(Topology(pp=2, dp=2), rank)
    loop.peak_memory_bytes = lambda device: (rank + 1) * 2 ** 20  # rank r peaks at r+1 MiB
    s = types.SimpleNamespace(memory_plan={0: 3 * 2 ** 20, 1: 3 * 2 ** 20}, groups=groups,
                              device=torch.device("cpu"),
                              logger=types.SimpleNamespace(print=printed.append))
    loop._report_planned_memory(s)
    assert s.memory_plan is None  # once
    return printed, groups.index("pp")


def test_each_stage_reports_the_max_over_its_ranks():
    results = run_on_ranks(_report, 4, timeout=60)
    stage_ranks = {}
    for rank, (_, stage) in enumerate(results):
        stage_ranks.setdefault(stage, []).append(rank)
    for printed, _ in results:
        assert len(printed) == 2
        for stage, ranks in stage_ranks.items():
            peak = (max(ranks) + 1) * 2 ** 20
            assert f"stage {stage}: planned peak 3.0 MiB, measured peak " \
                   f"{peak / 2 ** 20:.1f} MiB" in printed[stage]
