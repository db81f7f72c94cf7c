"""Multi-token prediction through checkpoints and evaluation, by the real program
(pretrain.main on forked gloo ranks, --mock-data, fp32):

* a run saved at iteration 2 in pp2 with untied embeddings (the last stage's MTP embedding
  is a copy of the first stage's: saved once) and resumed on one rank logs, at iterations 3
  and 4, the uninterrupted one-rank run's "lm loss", "mtp_1 loss" and "mtp_2 loss" (1e-4):
  the mtp.layers.N.* weights and their optimizer state load in another layout; `gigatron
  evaluate` of that pp2 checkpoint on one rank reports the one-rank run's validation loss at
  iteration 2 (the main model's);
* the logged "lm loss" and the validation loss are the main model's alone: with --lr 0 a
  model with two MTP depths logs the same train and validation losses as the same model
  without them (the main weights are name-seeded, so equal).
"""
from __future__ import annotations

import json

from multirank import run_on_ranks
from test_context_parallel import GPT, ROPE
from test_generation_cli import _command

MTP = ["--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"]
NAMES = ("lm loss", "mtp_1 loss", "mtp_2 loss")
FOUR = ["--train-iters", "4", "--lr-decay-style", "constant",
        "--untie-embeddings-and-output-weights", "--eval-interval", "2", "--eval-iters", "1"]


def _main(rank, world, argv):
    from gigatron.training.run import pretrain

    assert pretrain.main(argv) == 0


def _records(path, kind="train"):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


def test_mtp_checkpoint_saved_in_pp2_resumes_on_one_rank(tmp_path):
    ckpt, one, two, resumed = (str(tmp_path / n) for n in
                               ("ckpt", "one.jsonl", "pp2.jsonl", "resumed.jsonl"))
    base = GPT + ROPE + MTP + FOUR
    run_on_ranks(_main, 1, base + ["--metrics-file", one], timeout=300)
    run_on_ranks(_main, 2, base + ["--pipeline-model-parallel-size", "2", "--exit-interval",
                                   "2", "--save", ckpt, "--metrics-file", two], timeout=300)
    run_on_ranks(_main, 1, base + ["--load", ckpt, "--metrics-file", resumed], timeout=300)
    ref = {r["iteration"]: r for r in _records(one)}
    got = {r["iteration"]: r for r in _records(two) + _records(resumed)}
    assert sorted(got) == sorted(ref) == [1, 2, 3, 4]
    errors = [abs(got[i][n] - ref[i][n]) / abs(ref[i][n]) for i in ref for n in NAMES]
    print(f"max relative loss error {max(errors):.2e}")
    assert max(errors) <= 1e-4
    evaluated = str(tmp_path / "evaluate.jsonl")
    (code, _, err), = run_on_ranks(_command, 1, "cli.evaluate",
                                   ["--load", ckpt, "--metrics-file", evaluated], timeout=300)
    assert code == 0, err
    (record,) = _records(evaluated, "eval")
    (valid,) = [r for r in _records(one, "eval") if r["iteration"] == 2]
    assert record["iteration"] == 2
    assert abs(record["lm loss"] - valid["lm loss"]) / valid["lm loss"] <= 1e-5


def test_logged_and_validation_losses_are_the_main_models(tmp_path):
    flags = GPT + ROPE + ["--lr", "0", "--train-iters", "1", "--eval-interval", "1",
                          "--eval-iters", "1"]
    paths = str(tmp_path / "plain.jsonl"), str(tmp_path / "mtp.jsonl")
    run_on_ranks(_main, 1, flags + ["--metrics-file", paths[0]], timeout=300)
    run_on_ranks(_main, 1, flags + MTP + ["--metrics-file", paths[1]], timeout=300)
    (plain,), (mtp,) = (_records(p) for p in paths)
    assert "mtp_1 loss" in mtp and "mtp_1 loss" not in plain
    assert abs(mtp["mtp_1 loss"] - mtp["lm loss"]) > 1e-3  # a different loss, logged apart
    assert mtp["lm loss"] == plain["lm loss"]
    evals = [[r["lm loss"] for r in _records(p, "eval")] for p in paths]
    assert evals[0] and evals[0] == evals[1]
