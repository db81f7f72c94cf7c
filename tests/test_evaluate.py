"""`gigatron evaluate --load CKPT`: the loss (and perplexity) of the trainer's own validation
at that checkpoint, with no model or data flag; the same loss at tp=2, pp=2 and dp=2 from a
checkpoint saved on one rank; other splits and data by Megatron's flags."""
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
