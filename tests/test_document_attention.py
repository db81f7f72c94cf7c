"""Attention inside packed documents (parallel/context/band.py's document pieces) equals the
dense softmax masked to each document, alone and with a window and sinks, on one device and
over cp 2 for p2p, all_gather and a2a (forked gloo ranks); the mask is the test's only.
"""
import pytest
import torch

from gigatron.parallel.context import band
from gigatron.parallel.context.attention import context_parallel_attention
from gigatron.parallel.context.split import restore_sequence, split_for_rank
from multirank import run_on_ranks
from test_band_attention import S, _assert_close, _grads, inputs

DOCUMENTS = (0, 5, 13, 14, 27, 32)  # cut inside both cp halves and the 2 x cp chunks


def dense_document_reference(q, k, v, window, sink, scale, documents=DOCUMENTS):
    heads, s = q.shape[1], q.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) * scale
    doc = torch.bucketize(torch.arange(s), torch.tensor(documents[1:-1]), right=True)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None]
    seen = (j <= i) & (doc[:, None] == doc[None, :])
    if window is not None:
        seen &= i - j <= window
    scores = scores.masked_fill(~seen, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink[None, :, None, None].expand(*scores.shape[:3], 1)], -1)
    probs = scores.softmax(-1)
    return (probs[..., :s] if sink is not None else probs) @ v


@pytest.mark.parametrize("window,use_sink", [(None, False), (None, True), (3, True)])
def test_document_attention_equals_dense_document_mask(window, use_sink, monkeypatch):
    monkeypatch.setattr(band, "DEFAULT_BLOCK", 4)  # window blocks that straddle documents
    for kv_heads in (4, 2):
        q, k, v, sink, grad_out = inputs(kv_heads)
        sink = sink if use_sink else None
        got = _grads(lambda q, k, v, s: band.band_attention(q, k, v, window, s, 0.3,
                                                            DOCUMENTS), q, k, v, sink, grad_out)
        want = _grads(lambda q, k, v, s: dense_document_reference(q, k, v, window, s, 0.3),
                      q, k, v, sink, grad_out)
        _assert_close(got, want, f"documents window {window} kv {kv_heads}")


def test_pieces_of_other_documents_are_never_paired():
    chunks = band.sequence_chunks(S, None)
    blocks = band.plan_blocks(chunks, chunks, None, documents=DOCUMENTS)
    spans = list(zip(DOCUMENTS, DOCUMENTS[1:]))
    assert [(r.start, r.stop, c.start, c.stop, how) for r, c, how in blocks] == \
        [(a, b, a, b, "causal" if b - a > 1 else "full") for a, b in spans]
    assert band.document_pieces([(0, 8, 8), (8, 8, 24)], DOCUMENTS) == [
        (1, (0, 5, 8)), (2, (5, 1, 13)), (3, (6, 2, 14)), (3, (8, 3, 24)), (4, (11, 5, 27))]


def _cp_documents(rank, cp, cases):
    results = {}
    for comm_type, kv_heads, window in cases:
        q, k, v, sink, grad_out = inputs(kv_heads)
        q, k, v, grad_out = (split_for_rank(t, cp, rank, seq_dim=2) for t in (q, k, v, grad_out))
        sink = sink if window is not None else None
        results[comm_type, kv_heads, window] = _grads(
            lambda q, k, v, s: context_parallel_attention(
                q, k, v, None, comm_type, scale=0.3, window=window, sink=s,
                documents=DOCUMENTS), q, k, v, sink, grad_out)
    return results


def test_context_parallel_document_attention_equals_one_device():
    cases = [(c, kv, w) for c in ("p2p", "all_gather", "a2a") for kv, w in
             ((4, None), (2, 4))]
    per_rank = run_on_ranks(_cp_documents, 2, cases)
    for case in cases:
        n = 5 if case[2] is not None else 4
        got = [restore_sequence([r[case][i] for r in per_rank], seq_dim=2) for i in range(4)]
        got += [sum(r[case][4] for r in per_rank)] if n == 5 else []
        q, k, v, sink, grad_out = inputs(case[1])
        sink = sink if case[2] is not None else None
        want = _grads(lambda q, k, v, s: dense_document_reference(q, k, v, case[2], s, 0.3),
                      q, k, v, sink, grad_out)
        _assert_close(got, want, f"cp2 documents {case}")


def _hierarchical_documents(rank, world):
    from gigatron.parallel.topology import ProcessGroups, Topology

    groups = ProcessGroups(Topology.from_world_size(world, cp=world), rank,
                           hierarchical_cp=(2, world // 2))
    q, k, v, sink, grad_out = inputs(2)
    q, k, v, grad_out = (split_for_rank(t, world, rank, seq_dim=2) for t in (q, k, v, grad_out))
    return _grads(lambda q, k, v, s: context_parallel_attention(
        q, k, v, groups.cp_group, "a2a+p2p", scale=0.3, window=4, sink=s,
        documents=DOCUMENTS), q, k, v, sink, grad_out)


def test_cp4_a2a_p2p_document_attention_equals_one_device():
    per_rank = run_on_ranks(_hierarchical_documents, 4)
    got = [restore_sequence([r[i] for r in per_rank], seq_dim=2) for i in range(4)]
    got.append(sum(r[4] for r in per_rank))
    q, k, v, sink, grad_out = inputs(2)
    want = _grads(lambda q, k, v, s: dense_document_reference(q, k, v, 4, s, 0.3),
                  q, k, v, sink, grad_out)
    _assert_close(got, want, "cp4 a2a+p2p 2 x 2 documents")
