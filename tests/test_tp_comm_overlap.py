"""--tp-comm-overlap (issue 42, tensor-parallel half): the sequence-parallel all-gathers and
reduce-scatters of the transformer layers' linears run as rings of async point-to-point
chunks under the GEMMs (parallel/tensor/async_tp.py), with the same numbers.

Tolerance (fp32, dropout 0): losses and every gradient equal the plain collectives' with
rtol 1e-6 / atol 1e-7; the rings sum the tp partials in another order (bit-for-bit at tp 2
but for the chunked GEMM's rows). Measured on CPU (torch 2.13): tp2 and tp4, the largest
difference is 0 to a few 1e-8. The chunking is checked by counting: every overlapped linear
trades one all-gather or reduce-scatter for tp - 1 sends, and each GEMM chunk runs between
a ring step's issue and its wait.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.models.zoo import load_config
from gigatron.parallel import comm
from gigatron.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from gigatron.parallel.tensor import async_tp
from gigatron.parallel.tensor.async_tp import TPCommOverlap, enable_tp_comm_overlap

RTOL, ATOL = 1e-6, 1e-7


def _linears(model):
    return [m for m in model.decoder.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _train_step(model, ids, labels):
    comm.stats.reset()
    loss = model(ids, labels=labels).mean()
    loss.backward()
    return loss.detach(), dict(comm.stats.calls), {n: p.grad.clone()
                                                    for n, p in model.named_parameters()}


def _compare(rank, world_size, style, overlap):
    group = dist.new_group(list(range(world_size)))
    cfg = load_config(style, sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    plain = GPTModel(cfg, tp_group=group)
    ref_loss, ref_calls, ref_grads = _train_step(plain, ids, labels)
    model = GPTModel(cfg, tp_group=group)
    linears = _linears(model)
    assert enable_tp_comm_overlap(linears, overlap) == len(linears) == 4 * cfg.num_layers
    events = []
    _log_ring(events)
    loss, calls, grads = _train_step(model, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{style} tp{world_size} {name}: {m}")
    return calls, ref_calls, events, cfg.num_layers


def _log_ring(events):
    """Record ring issues, waits and GEMM chunks in the order they happen (this rank)."""
    start, wait, gemm = async_tp._Ring.start, async_tp._Ring.wait, async_tp._gemm

    def logged_start(self, tensor):
        events.append("issue")
        return start(self, tensor)

    def logged_wait(self):
        events.append("wait")
        return wait(self)

    def logged_gemm(fn, *args):
        events.append("gemm")
        return gemm(fn, *args)

    async_tp._Ring.start, async_tp._Ring.wait, async_tp._gemm = \
        logged_start, logged_wait, logged_gemm


@pytest.mark.parametrize("world_size,style", [(2, "debug-gpt2"), (4, "debug-llama")])
def test_overlapped_sequence_parallel_linears_give_the_same_loss_and_grads(world_size, style):
    per_rank = run_on_ranks(_compare, world_size, style, TPCommOverlap())
    for calls, ref_calls, events, layers in per_rank:
        linears = 4 * layers  # qkv and fc1 (column), proj and fc2 (row) per layer
        # forward: column all-gathers, row reduce-scatters; backward: the mirror
        assert ref_calls["all_gather"] - calls.get("all_gather", 0) == 2 * layers * 2
        assert ref_calls["reduce_scatter"] - calls.get("reduce_scatter", 0) == 2 * layers * 2
        assert calls["send"] == 2 * linears * (world_size - 1)  # forward and backward rings
        assert "send" not in ref_calls
        # every ring step but the last: issue, then the GEMM of the chunk held, then wait
        steps = "".join({"issue": "i", "gemm": "g", "wait": "w"}[e] for e in events)
        assert steps.count("igw") == 2 * linears * (world_size - 1)
        assert steps.count("g") == 2 * linears * world_size


def test_only_the_all_gathers_overlap_when_reduce_scatters_are_off():
    per_rank = run_on_ranks(_compare, 2, "debug-gpt2", TPCommOverlap(ag=True, rs=False))
    calls, ref_calls, _, layers = per_rank[0]
    assert ref_calls["all_gather"] - calls.get("all_gather", 0) == 4 * layers
    assert calls["reduce_scatter"] == ref_calls["reduce_scatter"]
    assert calls["send"] == 2 * 2 * layers
