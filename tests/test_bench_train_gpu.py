"""bench/bench_train_gpu.py runs end to end on the CPU (--device cpu --tiny) before any GPU
sees it, for the GPT and the Llama architecture: every path trains and is timed on the same
model (equal parameter counts), gigatron's timed steps make no host read, the profiler trace
is written, and --capacity reports the largest offloaded size that trains.

The --tiny run is a subprocess: the bench joins a one-rank process group and megatron-core's
CPU shims patch torch.cuda in its own process only. --capacity's parent joins no group and
patches nothing (each size runs in a child of its own), so it runs here: a process less.
Every bench process runs one intra-op thread: a second one only spins against the other
tests on a 2-core machine (the --tiny run measured 17.8 -> 8.4 CPU-s).
"""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                     "bench_train_gpu.py")


def _bench(tmp_path, *argv):
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--tiny",
                           "--out", str(tmp_path), *argv],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_tiny_run_times_every_path_on_the_same_model_without_host_syncs(tmp_path):
    pytest.importorskip("megatron.core")
    # the eager backend keeps the test fast; the torch.compile wrapping is the same
    stdout = _bench(tmp_path, "--sizes", "gpt2-124m", "llama-1b", "--compile-backend", "eager")
    report = json.loads((tmp_path / "results.json").read_text())
    for size in ("tiny-gpt2-124m", "tiny-llama-1b"):
        by_path = {r["path"]: r for r in report["results"] if r["size"] == size}
        assert set(by_path) == {"gigatron", "torch.compile", "megatron-core"}
        for r in by_path.values():
            assert "error" not in r, r
            assert r["micro_batch"] == 4 and r["tokens_per_s"] > 0
            assert r["tflops_per_device"] > 0
            assert r["mfu"] is None  # no peak for a CPU: MFU is never invented
        assert len({r["parameters"] for r in by_path.values()}) == 1, by_path
        assert by_path["gigatron"]["host_syncs"] == 0, by_path["gigatron"]["host_sync_sites"]
        assert os.path.getsize(by_path["gigatron"]["trace"]) > 0
        assert len(by_path["gigatron"]["top_kernels"]) == 10
        assert f"| {size} | megatron-core | 4 |" in stdout


def test_tiny_llama_keeps_the_llama_architecture():
    sys.path.insert(0, os.path.dirname(BENCH))
    from bench_train_gpu import _size, gigatron_flags, model_config, parse

    args = parse(["--device", "cpu", "--tiny"])
    arch = model_config(gigatron_flags(_size("llama-1b", True), 1, args, []))
    assert (arch.normalization, arch.activation, arch.position_embedding_type) == \
        ("RMSNorm", "swiglu", "rope")
    assert not arch.add_bias_linear and not arch.untie_embeddings_and_output_weights
    assert arch.rope_scaling and arch.rotary_base == 500000.0
    assert arch.num_attention_heads == 4 * arch.num_query_groups  # 32 heads / 8 groups
    assert arch.ffn_hidden_size == 4 * arch.hidden_size and arch.num_layers == 2


def test_micro_batch_search_takes_the_first_that_fits():
    sys.path.insert(0, os.path.dirname(BENCH))
    import torch
    from bench_train_gpu import largest_fitting

    def build(micro):
        if micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return 7, lambda tokens, labels: None

    micro, parameters, _, _ = largest_fitting(build, [8, 4, 2, 1], lambda m: (None, None),
                                  torch.device("cpu"))
    assert (micro, parameters) == (2, 7)
    with pytest.raises(RuntimeError, match="no micro-batch fits: 8: CUDA out of memory"):
        largest_fitting(build, [8, 4], lambda m: (None, None), torch.device("cpu"))


def test_capacity_reports_the_largest_offloaded_size_that_trains(tmp_path, capsys,
                                                                 monkeypatch):
    sys.path.insert(0, os.path.dirname(BENCH))
    from bench_train_gpu import main

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the size processes inherit it
    assert main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--capacity",
                 "--sizes", "gpt3-6.7b", "llama-8b", "--size-timeout", "240"]) == 0
    stdout = capsys.readouterr().out
    report = json.loads((tmp_path / "capacity.json").read_text())
    assert report["largest"] == "tiny-llama-8b"
    small, large = report["results"]
    assert large["parameters"] > small["parameters"] and large["tflops_per_device"] > 0
    assert "largest that trains with --optimizer-cpu-offload: tiny-llama-8b" in stdout
    # the host side of offload per parameter (tiny: the process's imports dominate)
    assert large["host_bytes_per_param"] == pytest.approx(
        large["host_peak_rss_gib"] * 2**30 / large["parameters"])
    assert "tiny-llama-8b: host peak RSS" in stdout and "host bytes/param, step" in stdout


def test_llama_1b_flops_count_swiglu_gqa_and_the_tied_output_once():
    sys.path.insert(0, os.path.dirname(BENCH))
    from bench_train_gpu import _size, gigatron_flags, model_config, parse
    from gigatron.training.observe.flops import flops_per_token

    arch = model_config(gigatron_flags(_size("llama-1b", False), 1, parse([]), []))
    h, ffn, kv, layers, vocab, seq = 2048, 8192, 8 * 64, 16, 128256, 2048
    layer = h * h + 2 * h * kv + h * h + 3 * h * ffn + 2 * h  # q, k+v, o, SwiGLU, 2 RMSNorm
    matmul = layers * layer + h + vocab * h  # + final norm + output (= the tied embedding)
    assert matmul == 1_235_814_400  # every parameter: the input lookup is the output matrix
    assert flops_per_token(arch) == 6 * matmul + 12 * layers * h * seq
