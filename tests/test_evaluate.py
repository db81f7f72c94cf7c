"""`gigatron evaluate --load CKPT`: the loss (and perplexity) of the trainer's own validation
at that checkpoint, with no model or data flag, also after a resume and at an older
iteration (--ckpt-step); the same loss at tp=2, pp=2 and dp=2 from a checkpoint saved on one
rank; other splits and data by Megatron's flags."""
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multirank import run_on_ranks  # noqa: E402
from test_generation_cli import _command  # noqa: E402

TRAIN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 100 "
         "--hidden-dropout 0 --attention-dropout 0 --train-iters 4 --eval-interval 4 "
         "--eval-iters 2 --no-progress").split()


def _records(path, kind="eval"):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["type"] == kind]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint, the run's validation loss at its last iteration)."""
    root = tmp_path_factory.mktemp("eval")
    folder, metrics = str(root / "ckpt"), str(root / "train.jsonl")
    (code, _, err), = run_on_ranks(_command, 1, "cli.pretrain",
                                   TRAIN + ["--save", folder, "--metrics-file", metrics])
    assert code == 0, err
    (valid,) = [r for r in _records(metrics) if r["split"] == "valid" and r["iteration"] == 4]
    return folder, valid["lm loss"]


def _evaluate(folder, world, tmp_path, *args):
    metrics = str(tmp_path / f"eval{world}{'_'.join(args)}.jsonl")
    results = run_on_ranks(_command, world, "cli.evaluate",
                           ["--load", folder, "--metrics-file", metrics, *args])
    assert [r[0] for r in results] == [0] * world, results
    (record,) = _records(metrics)
    return record, results[0][1]


def test_one_rank_gives_the_trainers_validation_loss_exactly(trained, tmp_path):
    folder, loss = trained
    record, stdout = _evaluate(folder, 1, tmp_path)
    assert record["split"] == "valid" and record["iteration"] == 4
    assert record["lm loss"] == loss  # same samples, same forward: fp32 on the CPU
    assert record["lm loss PPL"] == pytest.approx(math.exp(loss))
    assert "lm loss PPL" in stdout and "valid split: 8 samples" in stdout


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2"],
                                    ["--pipeline-model-parallel-size", "2"], []],
                         ids=["tp2", "pp2", "dp2"])
def test_two_rank_layouts_give_the_same_loss(trained, tmp_path, layout):
    """Within 1e-6 relative: tp splits the matmuls' sums, dp averages two halves."""
    folder, loss = trained
    record, _ = _evaluate(folder, 2, tmp_path, *layout)
    assert record["lm loss"] == pytest.approx(loss, rel=1e-6)


def test_other_split_and_iterations_by_flags(trained, tmp_path):
    folder, loss = trained
    test, stdout = _evaluate(folder, 1, tmp_path, "--eval-split", "test", "--eval-iters", "3")
    assert test["split"] == "test" and test["lm loss"] != loss
    assert "test split: 12 samples (3 batches of 4)" in stdout
    other, _ = _evaluate(folder, 1, tmp_path, "--split", "50,50,0")  # another valid share
    assert other["lm loss"] != loss


def test_an_empty_split_is_one_error_line(trained):
    folder, _ = trained
    (code, _, err), = run_on_ranks(_command, 1, "cli.evaluate",
                                   ["--load", folder, "--split", "100,0,0"])
    assert code == 2 and "the valid split has no data" in err, err


def test_a_layout_free_checkpoint_evaluates_on_one_rank_without_layout_flags(tmp_path):
    """Trained and saved at tp=2 (torch_dist): `gigatron evaluate --load` on one rank starts
    from one rank's layout, not the saved tp=2, and gives the run's validation loss."""
    folder, metrics = str(tmp_path / "ckpt"), str(tmp_path / "train.jsonl")
    results = run_on_ranks(_command, 2, "cli.pretrain",
                           TRAIN + ["--tensor-model-parallel-size", "2", "--save", folder,
                                    "--metrics-file", metrics])
    assert [r[0] for r in results] == [0, 0], results
    (valid,) = [r for r in _records(metrics) if r["split"] == "valid" and r["iteration"] == 4]
    record, _ = _evaluate(folder, 1, tmp_path)
    assert record["lm loss"] == pytest.approx(valid["lm loss"], rel=1e-6)


def test_every_logged_validation_is_reproduced_after_a_resume_and_by_ckpt_step(tmp_path):
    """A run validates every 2 iterations (each validation takes the next batches of the
    valid split), saves at 2 and 4, and is resumed to 8 with a longer --train-iters, which
    builds a larger valid split (one short document: more epochs, another order). Evaluate
    at each saved iteration (--ckpt-step; the latest without it) gives the loss the run
    logged there, exactly: the same samples from the split as that run built it."""
    folder, metrics = str(tmp_path / "ckpt"), str(tmp_path / "train.jsonl")
    common = TRAIN + ["--eval-interval", "2", "--save-interval", "2", "--lr-decay-iters", "8",
                      "--split", "4094,1,1", "--save", folder, "--load", folder,
                      "--metrics-file", metrics]
    for iterations in ("4", "8"):
        (code, out, err), = run_on_ranks(_command, 1, "cli.pretrain",
                                         common + ["--train-iters", iterations])
        assert code == 0, err
    logged = {r["iteration"]: r["lm loss"] for r in _records(metrics) if r["split"] == "valid"}
    assert sorted(logged) == [2, 4, 6, 8] and len(set(logged.values())) == 4
    for iteration in (2, 4, 6):
        record, stdout = _evaluate(folder, 1, tmp_path, "--ckpt-step", str(iteration))
        assert (record["iteration"], record["lm loss"]) == (iteration, logged[iteration])
        assert f"the run's validation at iteration {iteration}" in stdout
    record, _ = _evaluate(folder, 1, tmp_path)
    assert (record["iteration"], record["lm loss"], record["first_sample"]) == (
        8, logged[8], 3 * 8)  # the fourth validation: after three of 2 batches of 4
    # pretraining resumes from --ckpt-step's iteration, not the tracked one (Megatron's)
    (code, out, err), = run_on_ranks(_command, 1, "cli.pretrain", TRAIN + [
        "--load", folder, "--ckpt-step", "4", "--lr-decay-iters", "8", "--train-iters", "5",
        "--split", "4094,1,1", "--eval-interval", "2", "--save", str(tmp_path / "again")])
    assert code == 0, err
    assert f"loaded checkpoint {folder}/iter_0000004 (iteration 4," in out, out
    # that run's checkpoint records --ckpt-step 4 among its flags: evaluate loads its latest
    record, stdout = _evaluate(str(tmp_path / "again"), 1, tmp_path)
    assert record["iteration"] == 5 and "the run's next validation after iteration 5" in stdout


def test_a_ckpt_step_without_its_folder_names_the_iterations_there(trained):
    folder, _ = trained
    (code, _, err), = run_on_ranks(_command, 1, "cli.evaluate",
                                   ["--load", folder, "--ckpt-step", "3"])
    assert code == 2 and "--ckpt-step 3: " in err and "(iterations in " in err, err
    assert err.rstrip().endswith("4): give one of them"), err


def test_ckpt_step_without_load_is_one_line_naming_both_flags(capsys):
    from gigatron.cli import main

    assert main(["pretrain", *TRAIN, "--ckpt-step", "3"]) == 2
    err = capsys.readouterr().err
    assert "--ckpt-step 3 needs --load DIR" in err, err
