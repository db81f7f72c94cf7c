"""Zero-bubble schedules (zb-h1, zbv) as data: every pass once and in dependency order across
ranks, no deadlock, the bubble and memory the paper promises, 1F1B/interleaved unchanged."""

import hashlib
import json

import pytest

from gigatron.parallel.pipeline.render import main as schedule_command
from gigatron.parallel.pipeline.schedules import (
    COMMUNICATION, Backward, Forward, RecvActivation, RecvGrad, SendActivation, SendGrad,
    WeightGrad, build_schedule, is_first_stage, is_last_stage, message_boundary, peer)
from gigatron.parallel.pipeline.simulate import (ScheduleError, peak_activations,
                                                 peak_in_flight, simulate)

ZERO_BUBBLE = {"zb-h1": (1, "loop"), "zbv": (2, "v")}
# p in 2..8, m from p to 32: the smallest, an odd one, 2p and the largest
GRID = sorted({(p, m) for p in range(2, 9) for m in (p, p + 1, 2 * p, 32)})


def all_ranks(schedule, p, m, forward_only=False):
    v, _ = ZERO_BUBBLE.get(schedule, (1, "loop"))
    return [build_schedule(r, p, m, v, forward_only, schedule=schedule) for r in range(p)]


def run(schedule, p, m):
    return simulate(all_ranks(schedule, p, m), placement=ZERO_BUBBLE[schedule][1])


@pytest.mark.parametrize("schedule", sorted(ZERO_BUBBLE))
def test_every_chunk_and_microbatch_has_one_f_then_b_then_w_on_its_rank(schedule):
    v = ZERO_BUBBLE[schedule][0]
    for p, m in GRID:
        for rank, sched in enumerate(all_ranks(schedule, p, m)):
            seen = {}
            for op in sched:
                if isinstance(op, COMMUNICATION):
                    continue
                seen.setdefault((op.microbatch, op.chunk), []).append(type(op))
            assert seen == {(mb, c): [Forward, Backward, WeightGrad]
                            for mb in range(m) for c in range(v)}, (p, m, rank)


@pytest.mark.parametrize("schedule", sorted(ZERO_BUBBLE))
def test_all_ranks_run_without_deadlock_in_dependency_order(schedule):
    for p, m in GRID:
        result = run(schedule, p, m)  # raises on deadlock, mismatch or order
        assert all(len(t) == 3 * m * ZERO_BUBBLE[schedule][0] for t in result.timelines)
        forward = simulate(all_ranks(schedule, p, m, forward_only=True),
                           placement=ZERO_BUBBLE[schedule][1])
        assert all(len(t) == m * ZERO_BUBBLE[schedule][0] for t in forward.timelines)


def test_simulator_rejects_w_before_b_and_a_v_turn_taken_too_early():
    zb = all_ranks("zb-h1", 2, 2)
    first = list(zb[0])  # the first stage: its B sends nothing, so only W and B swap
    b, w = first.index(Backward(0, 0)), first.index(WeightGrad(0, 0))
    first[b], first[w] = first[w], first[b]
    with pytest.raises(ScheduleError, match="WeightGrad of micro-batch 0 at stage 0 starts "
                                            "before Backward"):
        simulate([first, zb[1]])
    v = all_ranks("zbv", 2, 2)
    turn = list(v[1])  # the last rank: chunk 1's forward needs chunk 0's, kept local
    a, b = turn.index(Forward(0, 0)), turn.index(Forward(0, 1))
    turn[a], turn[b] = turn[b], turn[a]
    with pytest.raises(ScheduleError, match="Forward of micro-batch 0 at stage 2 starts "
                                            "before Forward of stage 1"):
        simulate([v[0], turn], placement="v")


def test_zb_h1_bubble_is_p_minus_1_over_3m_plus_p_minus_1():
    # F = B = W = 1: (p-1)(F+B-W) idle in a step of m(F+B+W) + (p-1)(F+B-W) (Qi et al.)
    for p, m in GRID:
        result = run("zb-h1", p, m)
        for rank in range(p):
            assert result.bubble_fraction(rank) == pytest.approx((p - 1) / (3 * m + p - 1))


def test_zbv_is_within_four_units_of_the_startup_bound():
    # the last rank cannot start before p-1 chunk forwards: 6m + p - 1 units at best
    for p, m in GRID:
        bound = 6 * m + p - 1
        assert bound <= run("zbv", p, m).makespan <= bound + 4, (p, m)
        if p <= 4:
            assert run("zbv", p, m).makespan == bound, (p, m)


def test_p4_m8_zero_bubble_beats_1f1b_at_no_more_activation_memory():
    one_f_one_b = simulate(all_ranks("1f1b", 4, 8))
    base_bubble = one_f_one_b.mean_bubble_fraction()
    base_peak = peak_activations(all_ranks("1f1b", 4, 8), 1)
    assert base_bubble == pytest.approx(3 / 11) and base_peak == 4
    zb_h1, zbv = run("zb-h1", 4, 8).mean_bubble_fraction(), run("zbv", 4, 8).mean_bubble_fraction()
    assert zb_h1 == pytest.approx(3 / 27) and zb_h1 <= base_bubble / 2
    assert zbv == pytest.approx(3 / 51) and zbv <= base_bubble / 4
    assert peak_activations(all_ranks("zb-h1", 4, 8), 1) <= base_peak
    assert peak_activations(all_ranks("zbv", 4, 8), 2) <= base_peak


def test_split_backward_holds_activations_until_b_then_the_w_stash_until_w():
    sched = build_schedule(3, 4, 8, schedule="zb-h1")  # last rank: W's lag B's by 3
    assert peak_in_flight(sched, [1.0]) == (1, [1], [0])  # activations: 1F1B's last rank
    # a stash half a micro-batch's activations: after each F, 1 + 3 stashes (after a B: 4)
    assert peak_in_flight(sched, [1.0], [0.5]) == (2.5, [1], [3])
    assert peak_in_flight(sched, [1.0], [2.0]) == (8.0, [0], [4])  # a stash larger: after B
    unsplit = [op for op in sched if not isinstance(op, WeightGrad)]
    assert peak_in_flight(unsplit, [1.0], [0.5]) == (1, [1], [0])  # B frees all of it


def test_v_placement_turns_on_the_last_rank_and_ends_on_rank_0():
    p = 4
    assert is_first_stage(0, 0, p, "v") and not is_first_stage(0, 1, p, "v")
    assert is_last_stage(0, 1, p, 2, "v") and not is_last_stage(p - 1, 1, p, 2, "v")
    assert peer(SendActivation(0, 0), 1, p, "v") == (2, 0)
    assert peer(SendActivation(0, 1), 2, p, "v") == (1, 1)  # chunk 1 flows back down
    assert peer(SendGrad(0, 1), 1, p, "v") == (2, 1)
    assert peer(SendActivation(0, 0), p - 1, p, "v") == (p - 1, 1)
    for rank, sched in enumerate(all_ranks("zbv", p, 8)):
        for op in sched:
            if isinstance(op, COMMUNICATION):
                other, chunk = peer(op, rank, p, "v")
                assert other != rank  # the turn stays local: no message to oneself
                mirror = {SendActivation: RecvActivation, RecvActivation: SendActivation,
                          SendGrad: RecvGrad, RecvGrad: SendGrad}[type(op)]
                assert (message_boundary(op, rank, p, "v") ==
                        message_boundary(mirror(op.microbatch, chunk), other, p, "v"))


def test_loop_placement_keeps_todays_peers():
    for p in range(1, 5):
        for rank in range(p):
            for chunk in range(3):
                up = ((rank + 1) % p, chunk + (rank == p - 1))
                down = ((rank - 1) % p, chunk - (rank == 0))
                assert peer(SendActivation(0, chunk), rank, p) == up
                assert peer(RecvActivation(0, chunk), rank, p) == down
                assert is_first_stage(rank, chunk) == (rank == 0 and chunk == 0)
                assert is_last_stage(rank, chunk, p, 3) == (rank == p - 1 and chunk == 2)


def test_1f1b_and_interleaved_lists_are_byte_identical_to_before_zero_bubble():
    # sha256 of the lists the builders gave before issue 29 (commit f6184ed)
    h = hashlib.sha256()
    for pp in range(1, 9):
        for m in range(1, 3 * pp + 1):
            for v in (1, 2, 3):
                if v > 1 and m % pp:
                    continue
                for forward_only in (False, True):
                    for r in range(pp):
                        h.update(repr(build_schedule(r, pp, m, v, forward_only)).encode())
    assert h.hexdigest() == "e2663ffe61f172cfd4e9dbe8332a7d72645284a16a049b394dd95f9fd675abc5"


@pytest.mark.parametrize("schedule,v,flag", [
    ("zbv", 1, "--num-layers-per-virtual-pipeline-stage"), ("zbv", 3, "exactly 2"),
    ("zb-h1", 2, "--num-layers-per-virtual-pipeline-stage"),
    ("interleaved", 1, "--num-layers-per-virtual-pipeline-stage"), ("gpipe", 1, "zb-h1")])
def test_bad_combinations_name_the_schedule_flag_and_the_other(schedule, v, flag):
    with pytest.raises(ValueError, match="--pipeline-schedule") as err:
        build_schedule(0, 4, 8, v, schedule=schedule)
    assert flag in str(err.value) and "\n" not in str(err.value)


def test_schedule_command_json_prints_bubble_and_peak(capsys):
    figures = {}
    for schedule in ("1f1b", "zb-h1", "zbv"):
        assert schedule_command(["--schedule", schedule, "--pp", "4", "--num-microbatches",
                                 "8", "--json"]) == 0
        figures[schedule] = json.loads(capsys.readouterr().out)
    assert figures["1f1b"]["bubble_fraction"] == pytest.approx(3 / 11, abs=1e-6)
    assert figures["zb-h1"]["bubble_fraction"] == pytest.approx(3 / 27, abs=1e-6)
    assert figures["zbv"]["bubble_fraction"] == pytest.approx(3 / 51, abs=1e-6)
    assert [figures[s]["peak_activations"] for s in figures] == [4, 4, 4]
    assert figures["zb-h1"]["peak_activations_per_stage"] == [4, 3, 2, 1]
    assert figures["zb-h1"]["w_stash_per_stage"] == [0, 1, 2, 3]  # held beside them
    assert figures["1f1b"]["w_stash_per_stage"] == [0] * 4
    assert figures["zbv"]["virtual_chunks"] == 2
    schedule_command(["--schedule", "zbv", "--pp", "2", "--num-microbatches", "2"])
    grid = capsys.readouterr().out
    assert "W1b" in grid and "B0a" in grid and "B = W = 1 x F" in grid
    with pytest.raises(SystemExit):
        schedule_command(["--schedule", "zb-h1", "--pp", "2", "--num-microbatches", "2",
                          "--virtual-chunks", "2"])
    assert "--schedule zb-h1" in capsys.readouterr().err


class _RecordingSync:
    """A GradSync recording, per post-accumulate-grad hook, whether its chunk's sync was on."""

    def __init__(self, named_params):
        self.enabled, self.ready = {}, []  # ready: (name, sync enabled) per hook
        for *name, p in named_params:
            name = tuple(name)
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: self.ready.append((name, self.enabled[name[0]])))

    def enable_sync(self, chunk, enabled):
        self.enabled[chunk] = enabled

    def finish_sync(self):
        pass


def _single_rank_executor_run(schedule_name, virtual, split):
    """One rank runs `schedule_name` (split: as built; else with its W's dropped, the full
    backward in B) on GPT chunks; returns (losses, grads by chunk and name, sync)."""
    import torch

    from gigatron.models.config import TransformerConfig
    from gigatron.models.pipeline_chunks import GPTMicroBatchStep, build_model_chunks
    from gigatron.parallel.pipeline.executor import PipelineExecutor
    from gigatron.parallel.pipeline.partition import PipelinePartition, partition_layers

    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2,
                               vocab_size=64, seq_length=8, hidden_dropout=0.0,
                               attention_dropout=0.0, untie_embeddings_and_output_weights=True)
    partition = partition_layers(4, 1) if virtual == 1 else \
        PipelinePartition(1, 2, ((range(0, 2), range(2, 4)),), "v")
    chunks = build_model_chunks(config, partition, 0, None, 7)
    sync = _RecordingSync([(c, n, p) for c, chunk in enumerate(chunks)
                           for n, p in chunk.named_parameters()])
    executor = PipelineExecutor(chunks, None, 0, [0], grad_sync=sync,
                                micro_batch_step=GPTMicroBatchStep(),
                                placement="v" if virtual == 2 else "loop")
    schedule = build_schedule(0, 1, 3, virtual, schedule=schedule_name) if virtual == 1 else \
        _zbv_single_rank(3)
    if not split:
        schedule = [i for i in schedule if not isinstance(i, WeightGrad)]
    gen = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 9), generator=gen)
        batches.append({"input_ids": tokens[:, :-1], "labels": tokens[:, 1:],
                        "loss_mask": torch.ones(2, 8)})
    losses = executor.run(schedule, batches)
    grads = {(c, n): p.grad.clone() for c, chunk in enumerate(chunks)
             for n, p in chunk.named_parameters()}
    return losses, grads, sync


def _zbv_single_rank(m):
    """zbv's pass order on one rank holding both chunks of the V (pp = 1; no messages)."""
    out = []
    for mb in range(m):
        out += [Forward(mb, 0), Forward(mb, 1), Backward(mb, 1), Backward(mb, 0),
                WeightGrad(mb, 1), WeightGrad(mb, 0)]
    return out


@pytest.mark.parametrize("name,virtual", [("zb-h1", 1), ("zbv", 2)])
def test_the_executor_runs_split_backward_schedules_with_the_full_backwards_grads(name, virtual):
    """B then W gives every parameter the grads of the full backward; each parameter's grad
    is ready once per micro-batch, and sync is enabled only for the last of them (the last W
    for weights): the V's local hand-off between chunks carries activations and grads."""
    import torch

    losses, grads, sync = _single_rank_executor_run(name, virtual, split=True)
    ref_losses, ref_grads, _ = _single_rank_executor_run(name, virtual, split=False)
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for key in grads:
        torch.testing.assert_close(grads[key], ref_grads[key], rtol=0, atol=1e-6)
    assert sorted(name for name, _ in sync.ready) == sorted(list(grads) * 3)
    # the linears' weights (deferred to W) are ready with sync on exactly at their last W;
    # the rest (biases, norms, embeddings: computed in B) never during a B of sync off
    linears = {key for key in grads if key[1].endswith(("linear_qkv.weight", "linear_proj.weight",
                                                        "linear_fc1.weight", "linear_fc2.weight",
                                                        "output_layer.weight"))}
    assert len(linears) == 17
    enabled = [name for name, on in sync.ready if on]
    assert sorted(enabled) == sorted(linears)
    last_hook = {name: i for i, (name, _) in enumerate(sync.ready)}
    assert all(sync.ready[last_hook[name]][1] for name in linears)


def test_the_timeline_shows_b_and_w_as_separate_spans(monkeypatch):
    from gigatron.parallel import timeline

    spans = []
    monkeypatch.setattr(timeline, "on", True)
    monkeypatch.setattr(timeline, "now", lambda: 0)
    monkeypatch.setattr(timeline, "record", lambda name, start, args=None: spans.append(
        (name, args["stage"])))
    _single_rank_executor_run("zbv", 2, split=True)
    assert spans[:6] == [("forward mb 0 chunk 0", 0), ("forward mb 0 chunk 1", 1),
                         ("backward mb 0 chunk 1", 1), ("backward mb 0 chunk 0", 0),
                         ("weight grad mb 0 chunk 1", 1), ("weight grad mb 0 chunk 0", 0)]
    assert len(spans) == 18
