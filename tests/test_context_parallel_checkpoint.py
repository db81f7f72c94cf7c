"""Checkpoints of context-parallel runs: cp ranks hold the same weights (written once, by cp
rank 0) and distinct ZeRO shards (ZeRO shards over dp x cp: each owner writes its own), in
both formats; the torch_dist format is layout-free across cp sizes.

Real runs (pretrain.main on forked gloo ranks, --mock-data, fp32, RoPE, the tiny model of
tests/test_context_parallel.py): the uninterrupted one-rank run and a cp2 run with ZeRO 1
(Adam moments sharded over the two cp ranks) train 4 iterations, saving at 2 and 4. The cp2
checkpoint of iteration 4 read back on one process holds every element of every weight and
Adam moment (none left unwritten) and the weights are the cp2 run's. Resumed from iteration
2 at cp2, the run logs the uninterrupted cp2 run's losses and ends with its parameters
within 1e-6; resumed at cp1, cp4 (ZeRO 1) and cp2 x tp2 with sequence parallelism, the
losses equal the one-rank run's within 1e-6 and the parameters within 1e-5 (measured: losses
1e-7, parameters 2.3e-6 at all three, the rounding of the cp2 run's first two iterations:
tests/test_context_parallel.py measures 2e-5 for p2p over 3 iterations). A cp2 save whose
cp rank 1 leaves out its ZeRO shard of the Adam moments (tried on purpose) is refused by
DCP's global plan check (the boxes do not fill the tensor), so the save fails. The
per-rank (--ckpt-format torch) cp2 checkpoint has one file per cp rank, the weights only in
cp rank 0's, and resumes at cp2 as the uninterrupted cp2 run; at cp1 it is refused in one
line naming cp.

`gigatron evaluate` of the cp2 checkpoint runs at cp 1 and gives the cp2 run's validation
loss (of the per-rank one, at cp 2: exactly); `gigatron generate` runs at cp 1 and writes the one-rank checkpoint's tokens, and
refuses --context-parallel-size in one line.

Mixture of experts under cp (the model of tests/test_moe_parallel.py: aux and z losses, a
shared expert): cp2 x ep2 x dp2, cp2 (ep1), cp2 x ep2 and cp2 x tp2 x ep2 (etp1, sequence
parallel) log the one-rank run's LM and balancing losses and end with its parameters within
1e-4 over 2 iterations (measured: losses 6.7e-8, parameters 4e-7); an MoE cp2 x ep2
checkpoint resumes on one rank as the uninterrupted run (losses 1e-7, parameters 5.8e-6).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from multirank import run_on_ranks
from test_context_parallel import GPT, ROPE, _train_layout
from test_generation_cli import _command

TOL = 1e-6
LAYOUT_TOL = 1e-5  # parameters of another layout than the uninterrupted run's (see above)
SAVED_AT, ITERS = 2, 4
BASE = [f for f in GPT if f != "--eod-mask-loss"] + ROPE
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
BASE[BASE.index("--eval-iters") + 1] = "1"
BASE += ["--save-interval", str(SAVED_AT), "--eval-interval", str(SAVED_AT),
         "--split", "80,20,0"]
CP2 = ["--context-parallel-size", "2", "--zero-stage", "1"]
# a resumed run evaluates nothing: its last evaluation would come after its last step, and
# the evaluation tests read the uninterrupted runs' (~0.15 CPU-s a 4-rank run)
RESUMED = ["--eval-iters", "0"]
# name -> (ranks, flags, reference run, parameter tolerance)
RESUMES = {
    "cp2_zero1": (2, CP2, "cp2", TOL),
    "cp1": (1, [], "one", LAYOUT_TOL),
    "cp4_zero1": (4, ["--context-parallel-size", "4", "--zero-stage", "1"], "one",
                  LAYOUT_TOL),
    "cp2_tp2_sp": (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel"], "one", LAYOUT_TOL),
}


def _records(path, kind):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


def _launch(world, argv, folder):
    """(train losses, valid losses by iteration, full parameters) of one run."""
    metrics = os.path.join(folder, "metrics.jsonl")
    per_rank = run_on_ranks(_train_layout, world, argv, metrics, timeout=300)
    params = {}
    for rank_params in per_rank:  # cp and dp replicas hold the same parameters
        params.update(rank_params)
    valid = {r["iteration"]: r["lm loss"] for r in _records(metrics, "eval")}
    return [r["lm loss"] for r in _records(metrics, "train")], valid, params


def _relative(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _worst(got, want):
    assert set(got) == set(want)
    return max(_relative(got[n], want[n]) for n in want)


def _loss_error(got, want):
    assert len(got) == len(want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (checkpoint folder, train losses, valid losses, final parameters): the
    uninterrupted one-rank and cp2 runs (saving at 2 and 4) and the per-rank format cp2 run
    that saves at 2."""
    out = {}
    for name, world, argv in (("one", 1, []), ("cp2", 2, CP2),
                              ("cp2_torch", 2, CP2 + ["--ckpt-format", "torch",
                                                      "--exit-interval", str(SAVED_AT)])):
        folder = str(tmp_path_factory.mktemp(name))
        out[name] = (folder,) + _launch(world, BASE + argv + ["--save", folder], folder)
    assert len(out["one"][1]) == len(out["cp2"][1]) == ITERS
    assert _loss_error(out["cp2"][1], out["one"][1]) <= TOL
    return out


def test_the_cp2_checkpoint_holds_every_element_once_written(runs):
    """Read on one process into NaN-filled global tensors: a ZeRO shard no rank wrote would
    stay NaN."""
    from gigatron.training.checkpoint import folders as files
    from gigatron.training.checkpoint.torch_dist import save_load

    folder, _, _, params = runs["cp2"]
    path = files.iteration_dir(folder, ITERS)
    wanted = {k: torch.full(tuple(md.size), float("nan"))
              for k, md in save_load.entries(path).items() if hasattr(md, "size")}
    assert {k for k in wanted if k.startswith("model.")} == {f"model.{n}" for n in params}
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in wanted)
    save_load.read(path, wanted)
    for key, tensor in wanted.items():
        assert not tensor.isnan().any(), key
    for name, param in params.items():
        assert torch.equal(wanted[f"model.{name}"], param), name


@pytest.mark.parametrize("layout", list(RESUMES))
def test_a_cp2_checkpoint_resumes_in_any_layout_as_the_uninterrupted_run(runs, tmp_path,
                                                                         layout):
    world, argv, reference, tolerance = RESUMES[layout]
    _, want_losses, _, want_params = runs[reference]
    losses, _, params = _launch(world, BASE + argv + RESUMED + [
        "--load", runs["cp2"][0], "--ckpt-step", str(SAVED_AT)], str(tmp_path))
    assert len(losses) == ITERS - SAVED_AT  # it resumed at the saved iteration
    loss_error, param_error = _loss_error(losses, want_losses[SAVED_AT:]), \
        _worst(params, want_params)
    print(f"{layout}: loss error {loss_error:.2e}, param error {param_error:.2e}")
    assert loss_error <= TOL and param_error <= tolerance, (loss_error, param_error)


def test_a_per_rank_cp2_checkpoint_has_a_file_per_cp_rank_and_resumes_at_cp2(runs, tmp_path):
    from gigatron.training.checkpoint import folders as files

    _, want_losses, _, want_params = runs["cp2"]
    cp2 = runs["cp2_torch"][0]
    folder = files.iteration_dir(cp2, SAVED_AT)
    first, second = (files.rank_file(folder, {"tp": 0, "pp": 0, "dp": 0, "cp": c})
                     for c in (0, 1))
    assert first != second and os.path.isfile(first) and os.path.isfile(second)
    shards = [torch.load(p, weights_only=False) for p in (first, second)]
    assert "model" in shards[0] and "model" not in shards[1]  # the weights written once
    moments = [s["optimizer"] for s in shards]
    assert repr(moments[0]) != repr(moments[1])  # each cp rank its own ZeRO shard
    losses, _, params = _launch(2, BASE + CP2 + RESUMED + ["--load", cp2, "--ckpt-format",
                                                           "torch"], str(tmp_path))
    assert _loss_error(losses, want_losses[SAVED_AT:]) <= TOL
    assert _worst(params, want_params) <= TOL


def test_a_per_rank_cp2_checkpoint_refuses_another_cp_size_in_one_line(runs):
    from gigatron.training.checkpoint import folders as files

    folder = files.iteration_dir(runs["cp2_torch"][0], SAVED_AT)
    meta = files.read_metadata(folder)
    with pytest.raises(ValueError, match=r"saved with tp=1 pp=1 dp=1 cp=2 .* this run has "
                                         r"tp=1 pp=1 dp=1 cp=1"):
        files.check_layout(meta, {"tp": 1, "pp": 1, "dp": 1, "cp": 1, "virtual_chunks": 1},
                           folder)


def test_evaluate_of_a_cp2_checkpoint_gives_the_runs_validation_loss(runs, tmp_path):
    cp2, _, valid, _ = runs["cp2"]
    metrics = str(tmp_path / "eval.jsonl")
    (code, _, err), = run_on_ranks(_command, 1, "cli.evaluate",
                                   ["--load", cp2, "--metrics-file", metrics])
    assert code == 0, err
    (record,) = _records(metrics, "eval")
    assert record["iteration"] == ITERS
    assert record["lm loss"] == pytest.approx(valid[ITERS], rel=1e-5)


def test_evaluate_of_a_per_rank_cp2_checkpoint_runs_at_cp2(runs, tmp_path):
    """A per-rank checkpoint keeps the layout that wrote it: two ranks, cp 2 (one rank:
    the launch-size line)."""
    folder, _, valid, _ = runs["cp2_torch"]
    metrics = str(tmp_path / "eval.jsonl")
    results = run_on_ranks(_command, 2, "cli.evaluate",
                           ["--load", folder, "--metrics-file", metrics])
    assert [r[0] for r in results] == [0, 0], results
    (record,) = _records(metrics, "eval")
    assert record["iteration"] == SAVED_AT and record["lm loss"] == valid[SAVED_AT]


def test_generate_from_a_cp2_checkpoint_runs_at_cp1(runs, tmp_path):
    tokens = []
    for folder in (runs["cp2"][0], runs["one"][0]):
        out = str(tmp_path / f"{len(tokens)}.jsonl")
        (code, _, err), = run_on_ranks(_command, 1, "cli.generate", [
            "--load", folder, "--prompt", "5 9 17", "--max-new-tokens", "6", "--ignore-eod",
            "--output", out])
        assert code == 0, err
        with open(out) as f:
            tokens.append([json.loads(line)["tokens"] for line in f])
    assert tokens[0] == tokens[1] and len(tokens[0][0]) >= 6


def test_generate_refuses_context_parallelism_in_one_line(runs):
    (code, _, err), = run_on_ranks(_command, 1, "cli.generate", [
        "--load", runs["cp2"][0], "--prompt", "5", "--context-parallel-size", "2"])
    assert code != 0 and "runs with --context-parallel-size 1" in err, err


# ---- mixture of experts under context parallelism -------------------------------------------
MOE_LAYOUTS = {  # name -> (ranks, flags): the model of tests/test_moe_parallel.py
    "cp2_ep2_dp2": (4, "--context-parallel-size 2 --expert-model-parallel-size 2 "
                       "--moe-token-dispatcher-type alltoall"),
    "cp2_ep1": (2, "--context-parallel-size 2"),
    "cp2_ep2": (2, "--context-parallel-size 2 --expert-model-parallel-size 2 "
                   "--moe-token-dispatcher-type alltoall"),  # ep over the cp ranks alone
    "cp2_tp2_ep2_etp1_sp": (4, "--context-parallel-size 2 --tensor-model-parallel-size 2 "
                               "--sequence-parallel --expert-model-parallel-size 2 "
                               "--expert-tensor-parallel-size 1 "
                               "--moe-token-dispatcher-type allgather"),
}


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_under_context_parallelism_trains_the_one_device_model(tmp_path, layout):
    """The balancing losses are the micro-batch's (counts reduced over tp x cp) and their
    grads count once (a cp rank's share scaled by cp, as the averaged LM loss). Tried on
    purpose at cp2 x ep2 x dp2 (the 2 iterations of test_moe_parallel.py's SHORT): without
    the scale the parameters miss by 0.27; without the cp reduction (each cp rank's own
    chunks' losses, scaled) the logged losses by 1e-2 and the parameters by 0.28."""
    from test_moe_parallel import (ALLTOALL, RTOL, SHORT, _full_parameters, _losses,
                                   one_rank_reference)
    from test_moe_parallel import _train_layout as train_moe

    ref_params, ref_losses = one_rank_reference(tuple(SHORT + ALLTOALL))
    world, flags = MOE_LAYOUTS[layout]
    metrics = str(tmp_path / "metrics.jsonl")
    per_rank = run_on_ranks(train_moe, world, SHORT + flags.split(), metrics, timeout=300)
    losses, params = _losses(metrics), _full_parameters(per_rank)
    assert len(losses) == len(ref_losses) and {"load_balancing_loss", "z_loss"} <= \
        set(losses[0])
    loss_error = max(abs(got[k] - want[k]) / abs(want[k])
                     for got, want in zip(losses, ref_losses) for k in want)
    param_error = max(_relative(params[n], ref_params[n]) for n in ref_params)
    print(f"{layout}: loss error {loss_error:.2e}, param error {param_error:.2e}")
    assert loss_error <= RTOL and param_error <= RTOL, (loss_error, param_error)


def test_a_moe_cp2_ep2_checkpoint_resumes_on_one_rank(tmp_path):
    """Expert boxes (written by their owner in the expert-data-parallel group, which folds
    over cp), their ZeRO 1 moments and the dense shards over dp x cp."""
    from test_moe_checkpoint import MIXTRAL, SAVED_AT as MOE_SAVED_AT, _launch as launch_moe
    from test_moe_checkpoint import _loss_error as moe_loss_error
    from test_moe_checkpoint import _worst as moe_worst

    one, cp2 = str(tmp_path / "one"), str(tmp_path / "cp2")
    os.makedirs(one), os.makedirs(cp2)
    want_losses, want_params = launch_moe(1, MIXTRAL, one)
    launch_moe(2, MIXTRAL + ["--context-parallel-size", "2", "--expert-model-parallel-size",
                             "2", "--zero-stage", "1", "--save", cp2, "--exit-interval",
                             str(MOE_SAVED_AT)], cp2)
    resumed = str(tmp_path / "resumed")
    os.makedirs(resumed)
    losses, params = launch_moe(1, MIXTRAL + ["--load", cp2], resumed)
    loss_error = moe_loss_error(losses, want_losses[MOE_SAVED_AT:])
    param_error = moe_worst(params, want_params)
    print(f"moe cp2 x ep2 -> one rank: loss error {loss_error:.2e}, param error "
          f"{param_error:.2e}")
    assert loss_error <= TOL and param_error <= LAYOUT_TOL, (loss_error, param_error)
