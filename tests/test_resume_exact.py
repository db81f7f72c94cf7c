"""Resume is exact with dropout > 0: a run stopped and resumed logs the uninterrupted run's
losses bit for bit (fp32 on CPU), at 1 rank and at tp=2 x pp=2 x dp=2 (forked ranks).

Evaluation between the stop and the resume creates data loaders too: none of them may draw
from the RNG streams dropout uses (the data loader has its own generator, saved with the
checkpoint), or the resumed dropout masks shift.
"""
import os

import pytest

from test_training_loop import FLAGS, _program_on, _records

DROPOUT = ["--hidden-dropout", "0.2", "--attention-dropout", "0.2"]


def _losses(path):
    return {r["iteration"]: r["lm loss"] for r in _records(path) if r["type"] == "train"}


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 2)], ids=["1rank", "tp2-pp2-dp2"])
def test_stop_and_resume_with_dropout_is_bit_exact(tmp_path, tp, pp, dp):
    """The uninterrupted run saves at iteration 3 as it goes (the same save, at the same point
    of the loop, as a run stopped there by --exit-interval: one world less, ~1/3 of the
    8-rank case's CPU); the run resumed from that checkpoint logs its losses 4 and 5 (5: the
    restored optimizer state's first update), validating at 4 between them."""
    world = tp * pp * dp
    argv = FLAGS + DROPOUT + ["--train-iters", "5", "--eval-interval", "2",
                              "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp),
                              "--num-workers", "0"]
    whole, ckpt = str(tmp_path / "whole.jsonl"), str(tmp_path / "ckpt")
    results = _program_on(world, argv + ["--metrics-file", whole, "--save", ckpt,
                                         "--save-interval", "3"], timeout=300)
    assert {r[0] for r in results} == {0}, results
    assert os.path.isdir(os.path.join(ckpt, "iter_0000003"))
    resumed = str(tmp_path / "resumed.jsonl")
    results = _program_on(world, argv + ["--metrics-file", resumed, "--load", ckpt,
                                         "--ckpt-step", "3"], timeout=300)
    assert {r[0] for r in results} == {0}, results
    assert "loaded checkpoint" in results[0][2]
    expected, got = _losses(whole), _losses(resumed)
    assert sorted(expected) == list(range(1, 6)) and sorted(got) == [4, 5]
    assert got == {i: expected[i] for i in got}  # exact: fp32 on CPU, same masks, same data
    # the test can fail: dropout really changes the losses (a run without it differs)


def test_data_loader_never_draws_from_the_default_generator():
    import torch

    from gigatron.data.samplers import build_pretraining_data_loader

    class Samples:
        def __len__(self):
            return 16

        def __getitem__(self, i):
            import numpy as np
            return {"tokens": np.full(4, i)}

    before = torch.get_rng_state()
    batch = next(iter(build_pretraining_data_loader(Samples(), 4, 2, 0, 1, seed=7)))
    assert batch["tokens"][:, 0].tolist() == [4, 5]
    assert torch.equal(torch.get_rng_state(), before)


def test_changed_schedule_on_resume_is_an_error_unless_told_which_wins(tmp_path):
    """Megatron's --override-opt_param-scheduler / --use-checkpoint-opt_param-scheduler."""
    ckpt = str(tmp_path / "ckpt")
    base = FLAGS + ["--eval-iters", "0", "--lr-decay-style", "linear"]
    results = _program_on(1, base + ["--train-iters", "4", "--save", ckpt])
    assert results[0][0] == 0, results
    longer = base + ["--train-iters", "6", "--load", ckpt]

    code, err, _ = _program_on(1, longer)[0]
    assert code == 2
    assert "lr schedule of checkpoint" in err and "decay_steps" in err, err
    assert "32 in the checkpoint, 48 from the flags" in err, err
    assert "--use-checkpoint-opt_param-scheduler" in err and "--override-opt_param-scheduler" \
        in err
    assert len(err.strip().splitlines()) == 1, err

    def lr_at_5(extra):
        metrics = str(tmp_path / f"{extra[0]}.jsonl")
        code, err, out = _program_on(1, longer + extra + ["--metrics-file", metrics])[0]
        assert code == 0, err
        assert "lr schedule from the" in out
        return next(r["lr"] for r in _records(metrics) if r.get("iteration") == 5
                    and r["type"] == "train")

    from gigatron.training.config.run_config import LRScheduleConfig
    from gigatron.training.lr.megatron import learning_rate
    at = 4 * 8  # samples consumed before iteration 5
    assert lr_at_5(["--use-checkpoint-opt_param-scheduler"]) == pytest.approx(
        learning_rate(at, LRScheduleConfig(max_lr=1e-2, decay_steps=4 * 8)))
    assert lr_at_5(["--override-opt_param-scheduler"]) == pytest.approx(
        learning_rate(at, LRScheduleConfig(max_lr=1e-2, decay_steps=6 * 8)))

    code, err, _ = _program_on(1, longer + ["--override-opt_param-scheduler",
                                            "--use-checkpoint-opt_param-scheduler"])[0]
    assert code == 2 and "contradict" in err
