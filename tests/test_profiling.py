"""Megatron's --profile family: a CPU run with --use-pytorch-profiler writes each profiled
rank's torch.profiler trace where Megatron does, covering exactly the chosen steps; the nsys
path and --record-memory-history say on a CPU that they cannot happen."""
import contextlib
import gzip
import io
import json
import os
import re
from dataclasses import replace

import pytest

from multirank import run_on_ranks

from gigatron.training.config.arguments import parse_args
from gigatron.training.observe.profiling import ProfilingSettings, profiling_notes, trace_path
from gigatron.training.config.validation import ConfigError

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --lr 1e-3 --mock-data --vocab-size 64 --log-interval 1 "
        "--eval-iters 0 --no-progress --num-workers 0").split()


def _main(rank, world, argv):
    from gigatron.training.run import pretrain

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = pretrain.main(argv)
    return code, err.getvalue(), out.getvalue()


def _profiler_steps(path):
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sorted({int(m.group(1)) for e in events
                   for m in [re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name")))] if m})


def test_pytorch_profiler_traces_exactly_the_chosen_steps_on_the_chosen_ranks(tmp_path):
    """6 iterations, --profile-step-start 2 --profile-step-end 4: Megatron's schedule (wait
    1, warm-up 1, active 2) records iterations 2 and 3, on rank 1 only (--profile-ranks 1),
    in <--tensorboard-dir>/../torch_profile/rank-1.json.gz."""
    tb = tmp_path / "run" / "tb"
    argv = BASE + ["--train-iters", "6", "--profile", "--use-pytorch-profiler",
                   "--profile-step-start", "2", "--profile-step-end", "4",
                   "--profile-ranks", "1", "--tensorboard-dir", str(tb)]
    for code, err, out in run_on_ranks(_main, 2, argv, timeout=300):
        assert code == 0, err[-3000:] + out[-2000:]
    folder = tmp_path / "run" / "torch_profile"
    assert sorted(os.listdir(folder)) == ["rank-1.json.gz"]
    assert _profiler_steps(folder / "rank-1.json.gz") == [2, 3]


def test_trace_path_and_step_checks():
    assert trace_path("/a/b/tb", 3) == "/a/b/torch_profile/rank-3.json.gz"
    assert trace_path(None, 0) == os.path.join("torch_profile", "rank-0.json.gz")
    with pytest.raises(ConfigError, match="--profile-step-end 3 must be after "
                                          "--profile-step-start 3"):
        parse_args(BASE + "--train-iters 6 --profile --profile-step-start 3 "
                          "--profile-step-end 3".split(), 1)
    run = parse_args(BASE + ["--train-iters", "6", "--profile"], 1)
    profiling = run.settings.profiling
    assert (profiling.profile_step_start, profiling.profile_step_end,
            profiling.profile_ranks) == (10, 12, None)  # Megatron's defaults


def test_nsys_range_and_memory_history_say_they_need_cuda():
    settings = ProfilingSettings(profile=True, record_memory_history=True)
    notes = profiling_notes(settings, "cpu")
    assert len(notes) == 2
    assert "needs CUDA: nothing is profiled on this cpu; add --use-pytorch-profiler" in notes[0]
    assert "nothing is recorded on this cpu" in notes[1]
    assert profiling_notes(replace(settings, use_pytorch_profiler=True), "cpu") == [notes[1]]
    assert profiling_notes(settings, "cuda") == []
