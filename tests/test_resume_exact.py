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
    world = tp * pp * dp
    argv = FLAGS + DROPOUT + ["--train-iters", "6", "--eval-interval", "2",
                              "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp),
                              "--num-workers", "0"]
    whole = str(tmp_path / "whole.jsonl")
    results = _program_on(world, argv + ["--metrics-file", whole], timeout=300)
    assert {r[0] for r in results} == {0}, results
    ckpt, resumed = str(tmp_path / "ckpt"), str(tmp_path / "resumed.jsonl")
    stop = argv + ["--metrics-file", resumed, "--save", ckpt, "--exit-interval", "3"]
    results = _program_on(world, stop, timeout=300)
    assert {r[0] for r in results} == {0}, results
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    results = _program_on(world, argv + ["--metrics-file", resumed, "--load", ckpt],
                          timeout=300)
    assert {r[0] for r in results} == {0}, results
    assert "loaded checkpoint" in results[0][2]
    expected, got = _losses(whole), _losses(resumed)
    assert sorted(got) == list(range(1, 7))
    assert got == expected  # exact: fp32 on CPU, same masks, same data
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
