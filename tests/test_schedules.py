"""Pipeline schedules as data: exhaustive pure checks, simulation of all ranks, bubble size."""

import pytest

from gigatron.parallel.pipeline.schedules import (
    COMMUNICATION, Backward, Forward, RecvActivation, RecvGrad, SendActivation, SendGrad,
    build_schedule, check_num_microbatches, interleaved_one_f_one_b,
    last_grad_step_per_chunk, no_pipelining, one_f_one_b)
from gigatron.parallel.pipeline.render import render
from gigatron.parallel.pipeline.simulate import ScheduleError, simulate

# pp in 1..8, m in 1..3*pp, v in {1, 2, 3}; interleaving (v > 1) needs m % pp == 0.
GRID = [(pp, m, v) for pp in range(1, 9) for m in range(1, 3 * pp + 1) for v in (1, 2, 3)]
VALID = [(pp, m, v) for pp, m, v in GRID if v == 1 or m % pp == 0]


def all_ranks(pp, m, v, **kw):
    return [build_schedule(r, pp, m, v, **kw) for r in range(pp)]


def _check_rank_schedule(sched, rank, pp, m, v):
    done_fwd, done_bwd, received, got_grad = set(), set(), set(), set()
    for ins in sched:
        key = (getattr(ins, "microbatch", None), getattr(ins, "chunk", None))
        if isinstance(ins, RecvActivation):
            received.add(key)
        elif isinstance(ins, RecvGrad):
            got_grad.add(key)
        elif isinstance(ins, Forward):
            assert key not in done_fwd, f"forward twice {key}"
            first = rank == 0 and ins.chunk == 0
            assert first or key in received, f"forward {key} before its input arrived"
            done_fwd.add(key)
        elif isinstance(ins, Backward):
            assert key in done_fwd and key not in done_bwd, f"backward {key} out of order"
            last = rank == pp - 1 and ins.chunk == v - 1
            assert last or key in got_grad, f"backward {key} before its grad arrived"
            done_bwd.add(key)
        elif isinstance(ins, SendActivation):
            assert key in done_fwd, f"sends activation {key} before computing it"
        elif isinstance(ins, SendGrad):
            assert key in done_bwd, f"sends grad {key} before computing it"
        else:  # the optimizer and grad-reduction wait belong to the loop, not the schedule
            raise AssertionError(f"unexpected instruction {ins!r}")
    everything = {(mb, c) for mb in range(m) for c in range(v)}
    assert done_fwd == everything and done_bwd == everything
    assert isinstance(sched[-1], (Backward, SendGrad))  # the step ends with its last backward


@pytest.mark.parametrize("pp", range(1, 9))
def test_every_microbatch_and_chunk_runs_forward_then_backward_once(pp):
    for p, m, v in VALID:
        if p == pp:
            for rank in range(pp):
                _check_rank_schedule(build_schedule(rank, pp, m, v), rank, pp, m, v)


def test_all_ranks_simulate_without_deadlock_with_matching_messages():
    for pp, m, v in VALID:
        result = simulate(all_ranks(pp, m, v))  # raises ScheduleError on any mismatch
        assert all(len(t) == 2 * m * v for t in result.timelines)
        assert result.makespan >= 3 * m * v
        forward = simulate(all_ranks(pp, m, v, forward_only=True))
        assert all(len(t) == m * v for t in forward.timelines)


def test_one_f_one_b_keeps_at_most_pp_minus_rank_microbatches_in_flight():
    for pp, m, v in VALID:
        if v != 1:
            continue
        for rank in range(pp):
            in_flight = peak = 0
            for ins in build_schedule(rank, pp, m, 1):
                in_flight += isinstance(ins, Forward) - isinstance(ins, Backward)
                peak = max(peak, in_flight)
            assert peak == min(pp - rank, m), (pp, m, rank)


def test_one_f_one_b_warmup_is_pp_minus_rank_minus_one_forwards():
    sched = one_f_one_b(1, 4, 8)
    computes = [i for i in sched if isinstance(i, (Forward, Backward))]
    assert [type(i) for i in computes[:3]] == [Forward, Forward, Forward]  # 2 warm-up + 1
    assert isinstance(computes[3], Backward)


def test_one_f_one_b_bubble_fraction_is_p_minus_1_over_m_plus_p_minus_1():
    # Unit forward, backward = 2x forward: every rank idles (p-1)(f+b) of (m+p-1)(f+b).
    for pp, m, v in VALID:
        if v == 1:
            result = simulate(all_ranks(pp, m, 1), forward_time=1, backward_time=2)
            for rank in range(pp):
                assert result.bubble_fraction(rank) == pytest.approx((pp - 1) / (m + pp - 1))


def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1_and_smaller():
    # With a chunk's forward 1 and backward 2 (a full stage is v times that), the fill and
    # drain cost (p-1) chunk-steps instead of (p-1) stage-steps: fraction (p-1)/(v*m + p-1),
    # i.e. Megatron's bubble (p-1)/(v*m) of ideal time; strictly below 1F1B's for p > 1.
    for pp, m, v in VALID:
        if v > 1 and pp > 1:
            result = simulate(all_ranks(pp, m, v), forward_time=1, backward_time=2)
            expected = (pp - 1) / (v * m + pp - 1)
            for rank in range(pp):
                assert result.bubble_fraction(rank) == pytest.approx(expected)
                assert result.bubble_fraction(rank) < (pp - 1) / (m + pp - 1)


def test_last_backward_of_each_chunk_is_where_grad_sync_is_enabled():
    sched = interleaved_one_f_one_b(0, 2, 4, 2)
    backwards = [i for i in sched if isinstance(i, Backward)]
    last = last_grad_step_per_chunk(sched)
    for chunk in range(2):
        mine = [b for b in backwards if b.chunk == chunk]
        assert last[chunk] == mine[-1]


def test_split_schedules_enable_grad_sync_at_the_last_weight_grad_not_the_last_backward():
    from gigatron.parallel.pipeline.schedules import WeightGrad, build_schedule
    for rank in range(4):
        sched = build_schedule(rank, 4, 8, 1, schedule="zb-h1")
        grads = [i for i in sched if isinstance(i, (Backward, WeightGrad))]
        assert isinstance(grads[-1], WeightGrad)
        assert last_grad_step_per_chunk(sched) == {0: grads[-1]}


def test_no_pipelining_is_gradient_accumulation():
    sched = no_pipelining(0, 1, 3)
    assert sched == [Forward(0, 0), Backward(0, 0), Forward(1, 0), Backward(1, 0),
                     Forward(2, 0), Backward(2, 0)]
    assert not any(isinstance(i, COMMUNICATION) for i in sched)


def test_forward_only_schedules_have_no_backward():
    for pp, m, v in [(4, 8, 2), (3, 5, 1), (1, 2, 1)]:
        for sched in all_ranks(pp, m, v, forward_only=True):
            assert not any(isinstance(i, (Backward, SendGrad, RecvGrad))
                           for i in sched)
            assert sum(isinstance(i, Forward) for i in sched) == m * v


def test_simulator_catches_mismatched_order_and_deadlock():
    good = all_ranks(2, 2, 1)
    swapped = list(good[1])
    i, j = swapped.index(RecvActivation(0, 0)), swapped.index(RecvActivation(1, 0))
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(ScheduleError, match="expects"):
        simulate([good[0], swapped])
    starved = [[i for i in good[0] if not isinstance(i, SendActivation)], good[1]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(starved)


def test_render_shows_each_stage_and_its_bubble():
    text = render(all_ranks(4, 8, 1))
    lines = text.splitlines()
    assert len(lines) == 5 and all("bubble 27.3%" in line for line in lines[:4])
    assert lines[4].startswith("bubble: share of the step a stage sits idle")
    assert lines[3].split("|")[4].strip() == "F0"  # last stage starts after 3 forwards
    assert "F0a" in render(all_ranks(2, 4, 2)) and "B3b" in render(all_ranks(2, 4, 2))


@pytest.mark.parametrize("pp,m,v", [(2, 3, 2), (4, 6, 3), (3, 4, 2)])
def test_interleaving_needs_microbatches_a_multiple_of_pp(pp, m, v):
    with pytest.raises(ValueError, match="multiple of --pipeline-model-parallel-size"):
        build_schedule(0, pp, m, v)


def test_bad_microbatch_counts_name_the_flags():
    with pytest.raises(ValueError, match="--global-batch-size"):
        check_num_microbatches(0, 2, 1)
    with pytest.raises(ValueError, match="--num-layers-per-virtual-pipeline-stage"):
        check_num_microbatches(3, 2, 2)
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size"):
        no_pipelining(0, 2, 4)
    with pytest.raises(ValueError, match="outside"):
        one_f_one_b(4, 4, 4)
