"""The whole program in forked ranks: SIGTERM saves and exits, --finetune, --no-load-optim,
a checkpoint of another layout refuses to load, metrics records, fp16 skipped steps."""
import contextlib
import io
import json
import os
import re
import signal

import pytest
import torch

from multirank import run_on_ranks

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --mock-data --vocab-size 128 "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --eval-interval 3 "
         "--eval-iters 1 --no-progress --make-vocab-size-divisible-by 8").split()


def _main(rank, world, argv, sigterm_at=None, nan_at=None, inf_grads=False, max_skips=None):
    """pretrain_gpt.main on this rank; returns (exit code, stderr text)."""
    from gigatron.training.run import pretrain as pretrain_gpt
    from gigatron.training.run import loop
    from gigatron.training.run import nan_check

    if max_skips is not None:
        nan_check.MAX_CONSECUTIVE_SKIPS = max_skips
    if inf_grads and rank == 0:  # every step's grads overflow on rank 0; the loss stays finite
        real_step_inf = loop.train_step

        def overflowing(s, batches, progress):
            if progress.iteration == 0:
                next(s.chunks[0].parameters()).register_hook(lambda g: g * float("inf"))
            return real_step_inf(s, batches, progress)
        loop.train_step = overflowing

    if sigterm_at is not None and rank == 0:
        real_step = loop.train_step

        def step(s, batches, progress):
            if progress.iteration + 1 == sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)  # as SLURM does before the time limit
            return real_step(s, batches, progress)
        loop.train_step = step
    if nan_at is not None and rank == 0:
        real_step_nan = loop.train_step

        def poisoned(s, batches, progress):
            if progress.iteration + 1 == nan_at:  # rank 0's first weight becomes NaN
                with torch.no_grad():
                    next(s.chunks[0].parameters()).fill_(float("nan"))
            return real_step_nan(s, batches, progress)
        loop.train_step = poisoned
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = pretrain_gpt.main(argv)
    return code, err.getvalue(), out.getvalue()


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _program_on(world, argv, **kw):
    import sys
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return run_on_ranks(_main, world, argv, **kw)


def test_sigterm_saves_and_exits_then_resume_finishes(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    argv = FLAGS + ["--train-iters", "6", "--save", ckpt, "--load", ckpt, "--metrics-file",
                    metrics, "--exit-signal-handler", "--zero-stage", "1",
                    "--ckpt-format", "safetensors"]
    results = _program_on(2, argv, sigterm_at=4)
    assert [r[0] for r in results] == [0, 0]
    assert "exiting on SIGTERM at iteration 4" in results[0][2]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "4"
    results = _program_on(2, argv)
    assert "loaded checkpoint" in results[0][2]
    assert os.path.isfile(os.path.join(ckpt, "iter_0000004", "mp_rank_00_000_001",
                                       "model_optim_rng.safetensors"))
    records = _records(metrics)
    train = [r["iteration"] for r in records if r["type"] == "train"]
    assert train == [1, 2, 3, 4, 5, 6]
    evals = [(r["split"], r["iteration"]) for r in records if r["type"] == "eval"]
    assert ("valid", 3) in evals and ("valid", 6) in evals
    keys = {"lm loss", "lr", "grad norm", "loss scale", "skipped", "tokens_per_s",
            "tflops_per_device", "mfu", "peak_memory_mib", "consumed_samples", "timers_ms"}
    assert keys <= set(records[0])
    assert {"forward", "backward", "comm", "optimizer"} <= set(records[0]["timers_ms"])


def test_finetune_and_no_load_optim_and_layout_mismatch(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    fresh = str(tmp_path / "fresh.jsonl")
    code, _, _ = _program_on(1, FLAGS + ["--train-iters", "4", "--save", ckpt,
                                         "--ckpt-format", "torch",  # per-rank: layout-bound
                                         "--metrics-file", fresh])[0]
    assert code == 0
    tuned = str(tmp_path / "tuned.jsonl")
    code, _, out = _program_on(1, FLAGS + ["--train-iters", "2", "--load", ckpt, "--finetune",
                                           "--metrics-file", tuned])[0]
    assert code == 0
    first = [r for r in _records(tuned) if r["type"] == "train"]
    fresh_first = [r for r in _records(fresh) if r["type"] == "train"]
    assert first[0]["iteration"] == 1  # finetune restarts the count...
    assert first[0]["lm loss"] < fresh_first[0]["lm loss"] - 0.1  # ...from the trained weights
    code, _, out = _program_on(1, FLAGS + ["--train-iters", "6", "--load", ckpt,
                                           "--no-load-optim", "--no-load-rng"])[0]
    assert code == 0 and "iteration 4" in out and "done: iteration 6" in out
    results = _program_on(2, FLAGS + ["--train-iters", "6", "--load", ckpt,
                                      "--tensor-model-parallel-size", "2"])
    assert [r[0] for r in results] == [2, 2]
    assert "saved with tp=1 pp=1 dp=1 cp=1 virtual_chunks=1 but this run has tp=2" in results[0][1]


def test_fp16_overflow_is_a_skipped_step_that_keeps_the_lr(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    # a huge initial loss scale overflows fp16 grads: DeepSpeed-style backoff skips steps
    # (fp32 grad buffers: Megatron's fp16 default would also overflow the sum of the 4
    # micro-batches' grads at the scales this short run reaches)
    code, _, _ = _program_on(1, FLAGS + ["--train-iters", "6", "--fp16", "--initial-loss-scale",
                                         str(2.0 ** 24), "--hysteresis", "1",
                                         "--accumulate-allreduce-grads-in-fp32",
                                         "--metrics-file", metrics, "--lr-decay-style",
                                         "linear"])[0]
    assert code == 0
    train = [r for r in _records(metrics) if r["type"] == "train"]
    assert train[0]["skipped"] == 1 and train[0]["loss scale"] == 2.0 ** 24
    assert train[1]["loss scale"] == 2.0 ** 23  # halved after one overflow (hysteresis 1)
    first_ok = next(r for r in train if not r["skipped"])
    assert first_ok["lr"] == pytest.approx(1e-2)  # the schedule did not advance on skips


def test_sigterm_is_acted_on_at_the_next_log_interval_on_every_rank(tmp_path):
    """The exit flag rides on the log line's all-reduce: no per-step collective."""
    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--train-iters", "8", "--save", ckpt, "--exit-signal-handler",
                    "--log-interval", "3", "--eval-iters", "0"]
    results = _program_on(2, argv, sigterm_at=4)
    assert [r[0] for r in results] == [0, 0]
    assert "exiting on SIGTERM at iteration 6" in results[0][2]
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "6"


def test_nan_loss_stops_every_rank_naming_iteration_rank_and_last_good_checkpoint(tmp_path):
    """--check-for-nan-in-loss-and-grad (on by default): a NaN at iteration 3 is found before
    the next save (no checkpoint is written after it) and at the log line even when the log
    interval is longer; every rank exits non-zero and the line is printed once, by rank 0
    (issue 38: an error every rank finds is not printed once per rank); the named checkpoint
    resumes."""
    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--train-iters", "6", "--save", ckpt, "--save-interval", "2",
                    "--log-interval", "4"]
    results = _program_on(2, argv, nan_at=3)
    assert [r[0] for r in results] == [2, 2], results
    err = results[0][1]
    assert "non-finite loss or grad norm at iteration 3 (first seen on rank 0)" in err, err
    assert "last good checkpoint is iteration 2" in err, err
    assert "non-finite" not in results[1][1], results[1][1]  # the same line, not printed twice
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "2"
    results = _program_on(2, argv + ["--load", ckpt])
    assert [r[0] for r in results] == [0, 0]
    assert "loaded checkpoint" in results[0][2]


def test_nan_check_can_be_turned_off(tmp_path):
    argv = FLAGS + ["--train-iters", "3", "--no-check-for-nan-in-loss-and-grad"]
    results = _program_on(1, argv, nan_at=2)
    assert results[0][0] == 0, results


def test_fp16_gives_up_when_overflow_finds_the_loss_scale_at_its_minimum(tmp_path):
    """DeepSpeed's "loss scale already at minimum": 16 -> 8 -> 4 -> 2 -> 1 (hysteresis 1),
    then an overflow at the floor (iteration 5) stops every rank; rank 0 prints the line."""
    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--train-iters", "20", "--fp16", "--initial-loss-scale", "16",
                    "--min-loss-scale", "1", "--hysteresis", "1", "--eval-iters", "0",
                    "--save", ckpt, "--save-interval", "2"]
    results = _program_on(2, argv, inf_grads=True)
    assert [r[0] for r in results] == [2, 2], results
    err = results[0][1]
    assert ("fp16 loss scaling gave up at iteration 5: the step overflowed with the loss "
            "scale already at its minimum 1 (--min-loss-scale), 5 consecutive skipped "
            "steps") in err, err
    assert "no checkpoint was saved before it" in err, err  # iteration 2, 4 were skipped
    assert "gave up" not in results[1][1], results[1][1]  # printed once, by rank 0
    assert re.search(r"iteration +4/20 ", results[0][2])  # it trained (skipping) to the floor


def test_fp16_static_loss_scale_gives_up_after_a_bounded_run_of_skips(tmp_path):
    argv = FLAGS + ["--train-iters", "20", "--fp16", "--loss-scale", "128", "--eval-iters",
                    "0"]
    code, err, _ = _program_on(1, argv, inf_grads=True, max_skips=3)[0]
    assert code == 2, err
    assert "fp16 loss scaling gave up at iteration 3: the step overflowed 3 times in a row" \
        in err, err
