"""Metrics: the FLOPs formula, MFU, console/JSON/TensorBoard sinks and the progress display."""
import io
import json
import os
from types import SimpleNamespace

import pytest
import torch

from gigatron.training.observe.logger import MetricsLogger, ProgressBar, format_train_line
from gigatron.training.observe.flops import (device_peak_tflops, flops_per_token,
                                       matmul_parameter_count, peak_memory_bytes, throughput)

GPT2_124M = SimpleNamespace(num_layers=12, hidden_size=768, num_attention_heads=12,
                            num_query_groups=12, ffn_hidden_size=3072, add_bias_linear=True,
                            activation="gelu", normalization="LayerNorm", vocab_size=50257,
                            make_vocab_size_divisible_by=1, seq_length=1024)


def test_matmul_parameters_of_gpt2_124m_are_published_count_minus_position_table():
    # published 124,439,808 = N + learned position table (1024 x 768), tied embeddings
    assert matmul_parameter_count(GPT2_124M) + 1024 * 768 == 124_439_808


def test_flops_per_token_is_6n_plus_12lhs():
    n = matmul_parameter_count(GPT2_124M)
    assert flops_per_token(GPT2_124M) == 6 * n + 12 * 12 * 768 * 1024


def test_llama_style_count_matches_a_built_model():
    from gigatron.models.config import TransformerConfig
    from gigatron.models import gpt
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4,
                            num_query_groups=2, vocab_size=200, seq_length=16,
                            activation="swiglu", normalization="RMSNorm",
                            position_embedding_type="rope", add_bias_linear=False,
                            untie_embeddings_and_output_weights=True, ffn_hidden_size=96)
    model = gpt.GPTModel(cfg)
    total = sum(p.numel() for n, p in model.named_parameters() if "embedding" not in n)
    assert matmul_parameter_count(cfg) == total


def test_throughput_and_mfu():
    t = throughput(tokens=1e6, seconds=2.0, flops_token=1e9, world_size=4, peak_tflops=250.0)
    assert t["tokens_per_s"] == 5e5
    assert t["tflops_per_device"] == pytest.approx(5e5 * 1e9 / 4 / 1e12)
    assert t["mfu"] == pytest.approx(t["tflops_per_device"] / 250.0)
    assert throughput(1, 1, 1, 1, None)["mfu"] is None


def test_cpu_has_no_peak_but_reports_memory():
    assert device_peak_tflops(torch.device("cpu"), "fp32") is None
    assert peak_memory_bytes(torch.device("cpu")) > 10 * 2 ** 20


RECORD = {"iteration": 10, "consumed_samples": 160, "lm loss": 5.25, "lr": 1e-4,
          "grad norm": 1.5, "loss scale": 1.0, "skipped": 0, "tokens_per_s": 1234.0,
          "tflops_per_device": 0.5, "mfu": None, "ms_per_iteration": 12.5,
          "global_batch_size": 16, "peak_memory_mib": 100.0}


def test_console_line_has_megatron_fields():
    line = format_train_line(RECORD, 100)
    for text in ("iteration  10/100", "consumed samples:", "lm loss: 5.250000E+00",
                 "learning rate: 1.000000E-04", "grad norm: 1.500",
                 "number of skipped iterations:   0", "elapsed time per iteration (ms): 12.5"):
        assert text in line, line
    assert "MFU" not in line  # unknown peak: left out, not printed as 0
    assert "throughput per GPU (TFLOP/s/GPU): 0.5" in line


def test_cpu_throughput_is_shown_in_gflops_not_as_zero_tflops():
    line = format_train_line(dict(RECORD, tflops_per_device=0.00123), 100)
    assert "throughput per device (GFLOP/s/device): 1.23" in line, line
    assert "TFLOP/s" not in line


def test_metrics_file_and_tensorboard(tmp_path):
    out = io.StringIO()
    path = tmp_path / "m" / "metrics.jsonl"
    log = MetricsLogger(True, 100, str(path), str(tmp_path / "tb"), progress=False, stream=out)
    log.train(RECORD)
    log.evaluation({"split": "valid", "iteration": 10, "lm loss": 2.0})
    log.close()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert lines[0]["type"] == "train" and lines[0]["lm loss"] == 5.25
    assert lines[1] == {"type": "eval", "split": "valid", "iteration": 10, "lm loss": 2.0,
                        "lm loss PPL": pytest.approx(7.389056, rel=1e-6)}
    assert "validation" not in out.getvalue() and "valid loss at iteration 10" in out.getvalue()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def test_disabled_logger_writes_nothing(tmp_path):
    log = MetricsLogger(False, 10, str(tmp_path / "x.jsonl"))
    log.train(RECORD)
    log.close()
    assert not (tmp_path / "x.jsonl").exists()


def test_progress_bar_renders_fraction_and_eta():
    bar = ProgressBar(100, stream=io.StringIO(), width=10)
    bar.start = 0.0
    text = bar.render(50, 3.0, now=10.0)
    assert text.startswith("[#####.....] 50/100 (50%) loss 3.0000")
    assert text.endswith("ETA 0:10")  # 50 its in 10 s -> 50 more take 10 s


def test_banner_counts_ranks_in_english():
    from gigatron.training.run.pretrain import _ranks_phrase

    assert _ranks_phrase(1, "none") == "1 rank (no launcher)"
    assert _ranks_phrase(8, "torchrun") == "8 ranks (torchrun)"


def test_moe_flops_count_active_parameters_by_hand():
    from gigatron.models.config import TransformerConfig
    cfg = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                            num_query_groups=2, vocab_size=64, seq_length=8, ffn_hidden_size=24,
                            activation="swiglu", normalization="RMSNorm",
                            position_embedding_type="rope", add_bias_linear=False,
                            untie_embeddings_and_output_weights=True, num_moe_experts=4,
                            moe_router_topk=2, moe_ffn_hidden_size=8,
                            moe_shared_expert_intermediate_size=12, moe_layer_freq=[1, 0])
    attention = 16 * (16 + 16) + 16 * 16            # q 16, k+v 2 groups x 2 x 4 channels, proj
    dense_mlp = 16 * 48 + 24 * 16                   # SwiGLU fc1 [gate; up], fc2
    moe = 4 * 16 + 2 * (16 * 16 + 8 * 16) + (16 * 24 + 12 * 16)  # router, top-2, shared
    n = 2 * (attention + 2 * 16) + dense_mlp + moe + 16 + 128 * 16  # norms, output (V pad 128)
    assert n == 6224
    assert matmul_parameter_count(cfg) == n
    assert flops_per_token(cfg) == 6 * n + 12 * 2 * 16 * 8


def test_mixtral_flops_are_on_its_13b_active_parameters():
    from gigatron.models.zoo import load_config
    active = matmul_parameter_count(load_config("mixtral-8x7b"))
    # Mistral: 12.9B active of 46.7B, with the input embedding (32000 x 4096) N leaves out
    assert 12.85e9 < active + 32000 * 4096 < 12.95e9
