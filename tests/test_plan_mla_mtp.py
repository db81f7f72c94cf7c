"""`gigatron plan` for DeepSeek's two features (issue 39):

- multi-token prediction: the last stage keeps each depth's tensors (its embedding, norms,
  eh_proj's input, a transformer layer, another logits tensor) -- the plan equals what
  autograd keeps on the CPU (was short by the depths' whole share) -- and its step runs
  each depth's layer, eh_proj and logits;
- multi-latent attention under context parallelism: the latents and the cp attention's
  tensors at the one (padded) head size it runs -- the plan equals what the cp ranks keep
  (bench/bench_context_parallel.py's measure on forked gloo ranks; was 13-16% short).
"""
import os
import sys

import pytest
import torch

from test_mla import mla_config
from test_plan_memory import _held_activation_bytes
from test_plan_step_time import LLAMA, _plan

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.training.plan.context import ContextLayout
from gigatron.training.plan.memory import activation_terms, chunk_activations

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
MTP_CASES = [{"mtp_num_layers": 1}, {"mtp_num_layers": 2},
             {"mtp_num_layers": 1, "hidden_dropout": 0.0, "position_embedding_type": "rope",
              "normalization": "RMSNorm", "activation": "swiglu"},
             {"mtp_num_layers": 1, "recompute_granularity": "selective"},
             {"mtp_num_layers": 1, "recompute_granularity": "full",
              "recompute_method": "uniform", "recompute_num_layers": 1}]


@pytest.mark.parametrize("kw", MTP_CASES, ids=[str(sorted(k.items())) for k in MTP_CASES])
def test_mtp_depths_held_on_the_last_stage_as_autograd_keeps_them(kw):
    s, b, vocab, layers = 64, 2, 256, 2
    c = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4,
                          vocab_size=vocab, make_vocab_size_divisible_by=8, seq_length=s,
                          max_position_embeddings=s, **kw)
    torch.manual_seed(0)
    model = GPTModel(c).train()
    ids = torch.randint(0, vocab, (b, s))
    measured = _held_activation_bytes(model, lambda: model(input_ids=ids, labels=ids))
    planned, _ = chunk_activations(c, activation_terms(c, 1, on_gpu=False), layers, True,
                                   True, s * b)
    assert abs(planned / measured - 1) < 0.005, (planned, measured)


def test_mtp_depths_run_a_layer_eh_proj_and_the_logits_in_the_step():
    """Executed FLOPs grow by each depth's layer, eh_proj (2h -> h) and output layer,
    three GEMMs each; the forward by their forward."""
    none, one = _plan(LLAMA), _plan(LLAMA + ["--mtp-num-layers", "1"])
    c, tokens = none.run.model, 2048
    h, vocab = c.hidden_size, c.padded_vocab_size(1)
    per_layer = (none.cost.gemm_flops / none.run.train.num_microbatches -
                 3 * 2.0 * tokens * h * vocab) / 4
    grown = (one.cost.gemm_flops - none.cost.gemm_flops) / none.run.train.num_microbatches
    assert grown == pytest.approx(per_layer + 3 * 2.0 * tokens * (2 * h * h + h * vocab),
                                  rel=1e-9)
    assert one.cost.forward > none.cost.forward * 1.2  # 4 layers + logits -> 5 + 2 logits
    assert one.stages[0].activations > none.stages[0].activations


MLA_CP_CASES = [("p2p", {}), ("p2p", {"v_head_dim": 32}), ("a2a", {}),
                ("all_gather", {"recompute_granularity": "selective"})]


@pytest.mark.parametrize("comm_type,kw", MLA_CP_CASES,
                         ids=[f"{t}-{sorted(k.items())}" for t, k in MLA_CP_CASES])
def test_mla_under_cp_held_as_the_cp_ranks_keep_it(comm_type, kw):
    """q/k heads 24, v heads 16 (padded to 24 for the cp blocks) or 32 (q and k padded)."""
    sys.path.insert(0, BENCH_DIR)
    try:
        import bench_context_parallel as bench
    finally:
        sys.path.remove(BENCH_DIR)
    s, layers = 128, 2
    c = mla_config(**dict(dict(num_layers=layers, hidden_size=64, vocab_size=256,
                               make_vocab_size_divisible_by=8, seq_length=s,
                               max_position_embeddings=s, activation="swiglu",
                               q_lora_rank=32, kv_lora_rank=24, v_head_dim=16), **kw))
    measured = bench.measure(2, c, comm_type, 1)["activation_bytes"]
    planned, _ = chunk_activations(c, activation_terms(c, 1, False,
                                                       context=ContextLayout(2, comm_type)),
                                   layers, True, True, s // 2)
    assert planned == pytest.approx(measured, rel=0.005)
