"""Attention under the per-document context-parallel split (split.py's rule: every document's
length a multiple of 2 x cp): at cp2 with p2p, all_gather and a2a each rank holds chunks i
and 2cp-1-i of every document, and the outputs and gradients equal one device's (fp32,
forked gloo ranks)."""
import torch

from gigatron.parallel.context.attention import context_parallel_attention
from gigatron.parallel.context.split import (document_rank_positions, document_split_applies,
                                             split_documents_for_rank)
from multirank import run_on_ranks
from test_band_attention import S, _grads, inputs
from test_document_attention import dense_document_reference

DOCUMENTS = (0, 20, 24, 32)  # one long document among short ones, each a multiple of 4
CASES = [(c, kv, w) for c in ("p2p", "all_gather", "a2a") for kv, w in ((4, None), (2, 4))]


def _per_document(rank, cp):
    results = {}
    for comm_type, kv_heads, window in CASES:
        q, k, v, sink, grad_out = inputs(kv_heads)
        q, k, v, grad_out = (split_documents_for_rank(t, DOCUMENTS, cp, rank, seq_dim=2)
                             for t in (q, k, v, grad_out))
        sink = sink if window is not None else None
        results[comm_type, kv_heads, window] = _grads(
            lambda q, k, v, s: context_parallel_attention(
                q, k, v, None, comm_type, scale=0.3, window=window, sink=s,
                documents=DOCUMENTS), q, k, v, sink, grad_out)
    return results


def test_cp2_per_document_split_equals_one_device_and_balances_each_document():
    assert S == DOCUMENTS[-1] and document_split_applies(DOCUMENTS, 2)
    held = [document_rank_positions(DOCUMENTS, 2, r) for r in range(2)]
    for a, e in zip(DOCUMENTS, DOCUMENTS[1:]):
        assert [((p >= a) & (p < e)).sum().item() for p in held] == [(e - a) // 2] * 2
    per_rank = run_on_ranks(_per_document, 2)
    order = torch.argsort(torch.cat(held))
    for case in CASES:
        n = 5 if case[2] is not None else 4
        got = [torch.cat([r[case][i] for r in per_rank], dim=2).index_select(2, order)
               for i in range(4)]
        got += [sum(r[case][4] for r in per_rank)] if n == 5 else []
        q, k, v, sink, grad_out = inputs(case[1])
        sink = sink if case[2] is not None else None
        want = _grads(lambda q, k, v, s: dense_document_reference(q, k, v, case[2], s, 0.3,
                                                                  DOCUMENTS),
                      q, k, v, sink, grad_out)
        for name, g, w in zip(("out", "dq", "dk", "dv", "dsink"), got, want):
            assert (g - w).abs().max().item() < 1e-5, f"cp2 per-document {case}: {name}"
