"""`torchrun --max-restarts 1` with NCCL (issue 30): the rank killed -9 at iteration 6 of 10
restarts, meets its process group through our per-attempt store prefix over the agent's
store (NCCL's unique id travels through the same store as gloo's addresses), resumes from
the checkpoint of iteration 4 and logs the uninterrupted run's losses.

One GPU holds one NCCL rank, so this runs one rank: it checks NCCL's initialisation on a
restarted attempt, which is what went wrong with gloo (the previous attempt's keys). Run on
the device machine (`pytest -m cuda`, bench/gpu_session.sh).
"""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda

FLAGS = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --vocab-size 256 "
         "--log-interval 1 --eval-iters 0 --no-progress --train-iters 10 --save-interval 4 "
         "--num-workers 0").split()


def _port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(tmp_path, name, restarts, env=None):
    folder = tmp_path / name
    metrics, ckpt = str(folder / "m.jsonl"), str(folder / "ckpt")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
            "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{_port()}", "-m", "gigatron", "pretrain", *FLAGS, "--save", ckpt,
            "--load", ckpt, "--metrics-file", metrics]
    proc = subprocess.run(argv, text=True, capture_output=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    return proc, {r["iteration"]: r["lm loss"] for r in records if r["type"] == "train"}


def test_a_rank_killed_under_torchrun_max_restarts_resumes_over_nccl(tmp_path):
    assert torch.cuda.is_available()
    _, whole = _torchrun(tmp_path, "whole", 0)
    proc, resumed = _torchrun(tmp_path, "killed", 1, {"GIGATRON_KILL_RANK_AT": "0:6"})
    assert "nccl" in proc.stdout.lower(), proc.stdout[-2000:]  # the backend it ran on
    assert "loaded checkpoint" in proc.stdout and "iteration 4" in proc.stdout
    assert resumed == whole and sorted(whole) == list(range(1, 11))
