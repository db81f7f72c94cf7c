"""What a person reads of a run: evaluation progress, the end-of-run summary, TensorBoard
scalars, `gigatron plot`."""
import io
import json
import os
import sys

import pytest

from multirank import run_on_ranks

from gigatron.training.observe.logger import LoopProgress, MetricsLogger
from gigatron.training.observe.summary import RunTotals, format_summary

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 128 "
         "--hidden-dropout 0 --attention-dropout 0 --log-interval 2 --no-progress "
         "--make-vocab-size-divisible-by 8").split()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_evaluation_progress_in_a_log_is_a_line_every_interval_with_eta():
    lines, clock = [], FakeClock()
    shown = LoopProgress("valid evaluation", 10, lines.append, every_s=15.0, clock=clock)
    for done in range(1, 11):
        clock.now = 6.0 * done  # 6 s per batch
        shown.update(done)
    # a line when 15 s have passed since the last one, none at the end (the result follows)
    assert lines == ["valid evaluation: 3/10 batches (30%), 18 s elapsed, ETA 0:42",
                     "valid evaluation: 6/10 batches (60%), 36 s elapsed, ETA 0:24",
                     "valid evaluation: 9/10 batches (90%), 54 s elapsed, ETA 0:06"]


def test_a_fast_evaluation_prints_no_progress_line():
    lines, clock = [], FakeClock()
    shown = LoopProgress("valid evaluation", 5, lines.append, every_s=15.0, clock=clock)
    for done in range(1, 6):
        clock.now = float(done)
        shown.update(done)
    assert lines == []


def test_evaluation_progress_on_a_terminal_redraws_one_line():
    bar, clock = io.StringIO(), FakeClock()
    shown = LoopProgress("test evaluation", 4, print, bar_stream=bar, clock=clock)
    for done in range(1, 5):
        clock.now = 2.0 * done
        shown.update(done)
    frames = bar.getvalue().split("\r")[1:]
    assert len(frames) == 4 and all(f.endswith("\033[K") for f in frames)
    assert frames[0].startswith("test evaluation: 1/4 batches (25%), 2 s elapsed, ETA 0:06")


def test_non_reporting_ranks_show_no_evaluation_progress():
    out = io.StringIO()
    shown = MetricsLogger(False, 10, stream=out).loop_progress("valid evaluation", 3)
    shown.update(1)
    assert out.getvalue() == ""


def _train_with_fast_progress(rank, world, argv, every_s):
    """pretrain main on this rank with evaluation progress lines every `every_s` seconds."""
    import contextlib

    from gigatron.training.observe import logger
    from gigatron.training.run import pretrain

    logger.EVAL_PROGRESS_EVERY_S = every_s
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = pretrain.main(argv)
    return code, out.getvalue()


def test_evaluation_shows_progress_with_eta_in_non_tty_logs(tmp_path):
    argv = FLAGS + ["--train-iters", "2", "--eval-interval", "2", "--eval-iters", "3"]
    code, out = run_on_ranks(_train_with_fast_progress, 1, argv, 0.0)[0]
    assert code == 0
    assert "valid evaluation: 1/3 batches (33%)" in out and "ETA" in out, out
    assert "valid evaluation: 2/3 batches (67%)" in out
    assert "test evaluation: 1/3 batches" in out
    assert "\r" not in out  # no terminal redraws in a log


def _eval_host_reads(rank, world, argv, every_s):
    """Host reads made inside `evaluate` (progress shown every `every_s` seconds)."""
    from gigatron.training.observe import logger
    from gigatron.training.run import loop
    from gigatron.training.run import pretrain
    from gigatron.training.observe.host_syncs import HostSyncCounter

    logger.EVAL_PROGRESS_EVERY_S = every_s
    counter, real_evaluate = HostSyncCounter(), loop.evaluate

    def counted(*args, **kwargs):
        with counter:
            return real_evaluate(*args, **kwargs)
    loop.evaluate = counted
    assert pretrain.main(argv) == 0
    return counter.count, dict(counter.sites)


def test_evaluation_progress_reads_nothing_from_the_device():
    argv = FLAGS + ["--train-iters", "2", "--eval-interval", "2", "--skip-train-test"]
    quiet, _ = run_on_ranks(_eval_host_reads, 1, argv + ["--eval-iters", "1"], 1e9)[0]
    shown, sites = run_on_ranks(_eval_host_reads, 1, argv + ["--eval-iters", "4"], 0.0)[0]
    assert shown == quiet, sites  # the one final read, however many batches and lines


TRAIN = {"lm loss": 5.0, "lr": 1e-3, "grad norm": 1.0, "loss scale": 1.0, "skipped": 0,
         "tokens_per_s": 100.0, "tflops_per_device": 0.001, "mfu": None,
         "peak_memory_mib": 10.0, "consumed_samples": 8, "global_batch_size": 4}


def test_run_totals_add_logged_steps_and_keep_final_and_best_validation_loss():
    totals = RunTotals(start_iteration=10)
    totals.add_train(dict(TRAIN, iteration=12, ms_per_iteration=500.0))
    totals.add_train(dict(TRAIN, iteration=15, ms_per_iteration=100.0))
    for iteration, loss in ((12, 4.0), (14, 3.5), (15, 3.7)):
        totals.add_eval({"split": "valid", "iteration": iteration, "lm loss": loss})
    assert totals.train_steps == 5 and totals.train_seconds == pytest.approx(1.3)
    assert totals.loss_fields("valid") == {
        "final_valid_loss": 3.7, "final_valid_iteration": 15,
        "best_valid_loss": 3.5, "best_valid_iteration": 14}
    assert totals.loss_fields("test")["final_test_loss"] is None


def test_summary_text_names_time_tokens_losses_throughput_memory_and_paths():
    record = {"iteration": 120, "consumed_samples": 3840, "skipped_iterations": 0,
              "wall_seconds": 151.2, "tokens_this_run": 245760, "tokens_total": 491520,
              "train_steps": 120, "train_seconds": 110.0, "tokens_per_s": 4467.0,
              "tflops_per_device": 0.00085, "mfu": None, "peak_memory_mib": 412.0,
              "final_valid_loss": 4.12, "final_valid_iteration": 120,
              "best_valid_loss": 4.10, "best_valid_iteration": 100,
              "checkpoint": "/r/ckpt/iter_0000120", "metrics_file": "/r/metrics.jsonl",
              "tensorboard_dir": None}
    text = format_summary(record)
    for part in ("done: iteration 120", "wall time 2 min 31 s",
                 "245,760 this run, 491,520 in total",
                 "validation loss: final 4.1200 (iteration 120), best 4.1000 (iteration 100)",
                 "4,467 tokens/s, 0.85 GFLOP/s per device", "peak memory: 412 MiB",
                 "checkpoint: /r/ckpt/iter_0000120", "metrics: /r/metrics.jsonl",
                 "gigatron plot /r/metrics.jsonl"):
        assert part in text, text
    assert "MFU" not in text and "tensorboard" not in text  # unknown or not asked: left out


def _run(rank, world, argv):
    import contextlib

    from gigatron.training.run import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = pretrain.main(argv)
    return code, out.getvalue()


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_run_ends_with_a_summary_on_the_console_and_in_the_metrics_file(tmp_path):
    metrics, ckpt = str(tmp_path / "m.jsonl"), str(tmp_path / "ckpt")
    argv = FLAGS + ["--train-iters", "6", "--eval-interval", "2", "--eval-iters", "1",
                    "--save", ckpt, "--load", ckpt, "--metrics-file", metrics]
    code, out = run_on_ranks(_run, 2, argv + ["--exit-interval", "4"])[0]
    assert code == 0
    summary = _records(metrics)[-1]
    assert summary["type"] == "summary" and summary["iteration"] == 4
    assert summary["tokens_this_run"] == summary["tokens_total"] == 4 * 4 * 16
    valid = [r for r in _records(metrics) if r["type"] == "eval" and r["split"] == "valid"]
    assert summary["final_valid_loss"] == valid[-1]["lm loss"]
    assert summary["best_valid_loss"] == min(r["lm loss"] for r in valid)
    assert summary["train_steps"] == 4 and summary["tokens_per_s"] > 0
    assert summary["peak_memory_mib"] > 10 and summary["wall_seconds"] > 0
    assert summary["checkpoint"] == os.path.join(ckpt, "iter_0000004")
    assert f"metrics: {metrics}" in out and "tokens trained: 256 this run" in out, out
    # a resumed run counts its own tokens and the total
    code, out = run_on_ranks(_run, 2, argv)[0]
    assert code == 0
    summary = _records(metrics)[-1]
    assert summary["tokens_this_run"] == 2 * 4 * 16 and summary["tokens_total"] == 6 * 4 * 16
    assert "tokens trained: 128 this run, 384 in total" in out


class FakeWriter:
    def __init__(self) -> None:
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)

    def close(self):
        pass


def test_tensorboard_gets_ms_per_iteration_and_every_timer():
    log = MetricsLogger(True, 10, progress=False, stream=io.StringIO())
    log._tb = FakeWriter()
    log.train(dict(TRAIN, iteration=2, ms_per_iteration=12.5,
                   timers_ms={"forward": 4.0, "backward": 6.0, "optimizer": 1.5}))
    scalars = log._tb.scalars
    assert scalars["ms_per_iteration"] == (12.5, 2)
    assert scalars["timers_ms/forward"] == (4.0, 2)
    assert scalars["timers_ms/backward"] == (6.0, 2)
    assert scalars["timers_ms/optimizer"] == (1.5, 2)
    assert "mfu" not in scalars  # None: not written as a number


def test_tensorboard_event_file_holds_the_timer_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(True, 10, tensorboard_dir=str(tmp_path), progress=False,
                        stream=io.StringIO())
    log.train(dict(TRAIN, iteration=2, ms_per_iteration=12.5, timers_ms={"forward": 4.0}))
    log.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"ms_per_iteration", "timers_ms/forward", "lm loss"} <= tags
    assert events.Scalars("timers_ms/forward")[0].value == 4.0
