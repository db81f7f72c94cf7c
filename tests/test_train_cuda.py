"""Training on one GPU (issue 21): a few bf16 steps of gigatron's own train_step through the
run's builders, with the fused kernels forced (GIGATRON_OPS_BACKEND=kernel, unfused
attention so the masked-softmax kernel runs too) and with torch's ops and SDPA.

Each step overfits one fixed batch, so the loss must fall: every loss finite and the last
under the first minus 1.0 (a vocabulary of 128 starts near ln 128 = 4.85). Parameters are
bf16 with fp32 master shards; the timed steps make no host read (HostSyncCounter); the
offloaded optimizer steps CPU masters. The bench itself runs end to end on the GPU at tiny
sizes. Skipped without CUDA (tests/conftest.py); run these alone (`-m cuda`): they join a
one-rank NCCL group in the pytest process.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
FLAGS = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --vocab-size 128 "
         "--make-vocab-size-divisible-by 128 --seq-length 256 --max-position-embeddings 256 "
         "--micro-batch-size 4 --global-batch-size 4 --train-iters 1000 --lr 1e-3 --bf16 "
         "--mock-data --hidden-dropout 0 --attention-dropout 0 --clip-grad 1.0").split()


def _session(extra):
    from bench_train_gpu import build_gigatron, init_single_process

    device = torch.device("cuda", 0)
    init_single_process(device)
    return build_gigatron(FLAGS + extra, device), device


def _batch(device):
    tokens = torch.randint(0, 128, (4, 257), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.parametrize("ops_backend, attention, extra", [
    ("kernel", "unfused", []),
    ("torch", "sdpa", []),
    ("torch", "sdpa", ["--use-distributed-optimizer", "--optimizer-cpu-offload"]),
], ids=["fused_kernels", "torch_sdpa", "cpu_offload"])
def test_bf16_steps_are_finite_and_the_loss_falls(monkeypatch, ops_backend, attention, extra):
    from gigatron.training.observe.host_syncs import HostSyncCounter

    monkeypatch.setenv("GIGATRON_OPS_BACKEND", ops_backend)
    (session, step), device = _session(["--attention-backend", attention] + extra)
    assert {p.dtype for c in session.chunks for p in c.parameters()} == {torch.bfloat16}
    masters = {g.master.dtype for g in session.zero.flat_groups}
    assert masters == {torch.float32}
    offloaded = "--optimizer-cpu-offload" in extra
    assert {g.master.device.type for g in session.zero.flat_groups} == \
        {"cpu" if offloaded else "cuda"}
    batch = _batch(device)
    losses = [step(*batch)]
    counter = HostSyncCounter()
    with counter:
        for _ in range(11):
            losses.append(step(*batch))
    values = torch.stack(losses).float().cpu()
    assert torch.isfinite(values).all(), values
    assert values[-1] < values[0] - 1.0, values
    if not offloaded:  # the offloaded step copies grads to the host by design
        assert counter.count == 0, counter.sites


def test_bench_runs_every_path_at_tiny_sizes_on_the_gpu(tmp_path):
    paths = ["gigatron", "plain"] + (["megatron"] if _importable("megatron.core") else [])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "bench_train_gpu.py"),
                           "--device", "cuda", "--tiny", "--sizes", "gpt2-124m",
                           "--out", str(tmp_path), "--paths", *paths],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())["results"]
    assert len(results) == len(paths)
    for r in results:
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0
    gigatron = next(r for r in results if r["path"] == "gigatron")
    assert gigatron["host_syncs"] == 0, gigatron["host_sync_sites"]
    assert gigatron["top_kernels"], "the profiler saw no CUDA kernel"


def _importable(name):
    try:
        __import__(name)
    except ImportError:
        return False
    return True
