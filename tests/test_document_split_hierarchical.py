"""--cp-comm-type a2a+p2p (hierarchical, A x P) under the per-document context-parallel split:
packed documents whose lengths all divide by 2 x cp are split per document as for the other
comm types (split.py's rule), the inner (a2a) group's gathered pieces are put into the outer
ring's per-document split, and the ring plans each document's chunks.

- Pure: the inner group's pieces in `document_coarse_order_index` order are exactly the
  per-document split over the P ranks of the outer ring (several A x P).
- The attention at cp4 as 1 x 4, 4 x 1 and 2 x 2 (documents of 24 and 8 tokens, plain and
  with a window and sinks): outputs and q/k/v grads equal the dense document-masked softmax
  (1e-5).
- GPTModel at cp4 as 2 x 2 on forked gloo ranks, through the ProcessGroups that register the
  sub-groups: a micro-batch of a per-document sample (documents of 24 and 8 tokens) and a
  sample whose documents do not divide by 8 (13 and 19 tokens: the whole-sequence split, the
  fallback) gives each document's own per-token loss, equal to the document run alone with
  the same weights, and the one-rank parameter gradients (fp32, 1e-5), with plain attention,
  gpt-oss's sliding window with sinks and multi-latent attention.
"""
import pytest
import torch

from gigatron.data.documents import CU_SEQLENS
from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel.context.hierarchical import document_coarse_order_index
from gigatron.parallel.context.split import (document_rank_positions, document_split_applies,
                                             rank_positions)
from multirank import run_on_ranks
from test_band_attention import _grads, inputs
from test_document_attention import dense_document_reference
from test_packed_documents import BASE, KINDS, _expected, _loss, documents, packed_batch

SEQ = 32
PER_DOCUMENT, WHOLE = (24, 8), (13, 19)
MODEL_KINDS = ("plain", "band", "mla")


@pytest.mark.parametrize("inner, outer", [(2, 2), (2, 3), (4, 2), (1, 4), (4, 1)])
def test_inner_group_document_pieces_are_the_rings_per_document_split(inner, outer):
    cp = inner * outer
    bounds = [0, 2 * cp, 6 * cp, 8 * cp]  # documents of 2, 4 and 2 chunks per cp rank
    for k in range(outer):
        gathered = torch.cat([document_rank_positions(bounds, cp, k * inner + i)
                              for i in range(inner)])
        want = (document_rank_positions(bounds, outer, k) if outer > 1
                else torch.arange(bounds[-1]))
        order = document_coarse_order_index(bounds, inner, outer, k)
        assert torch.equal(gathered[order], want), (inner, outer, k)


ATTENTION_SIZES = [(1, 4), (4, 1), (2, 2)]
DOCUMENTS = (0, 24, 32)


def _attention(rank, world):
    from gigatron.parallel.context.attention import context_parallel_attention
    from gigatron.parallel.context.split import split_documents_for_rank
    from gigatron.parallel.topology import ProcessGroups, Topology

    out = {}
    for sizes in ATTENTION_SIZES:
        groups = ProcessGroups(Topology.from_world_size(world, cp=world), rank,
                               hierarchical_cp=sizes)
        for window in (None, 4):
            q, k, v, sink, grad_out = (
                t if i == 3 else split_documents_for_rank(t, DOCUMENTS, world, rank, seq_dim=2)
                for i, t in enumerate(inputs(4)))
            out[sizes, window] = _grads(lambda q, k, v, s: context_parallel_attention(
                q, k, v, groups.cp_group, "a2a+p2p", scale=0.3, window=window, sink=s,
                documents=DOCUMENTS), q, k, v, sink if window else None, grad_out)
    return out


def test_cp4_a2a_p2p_attention_per_document_equals_the_dense_document_mask():
    per_rank = run_on_ranks(_attention, 4)
    order = torch.argsort(torch.cat([document_rank_positions(DOCUMENTS, 4, r)
                                     for r in range(4)]))
    for sizes, window in per_rank[0]:
        q, k, v, sink, grad_out = inputs(4)
        sink = sink if window else None
        want = _grads(lambda q, k, v, s: dense_document_reference(q, k, v, window, s, 0.3,
                                                                  DOCUMENTS),
                      q, k, v, sink, grad_out)
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = torch.cat([r[sizes, window][i] for r in per_rank], dim=2)
            err = (got.index_select(2, order) - want[i]).abs().max().item()
            assert err < 1e-5, (sizes, window, name, err)


def _batch():
    return packed_batch([documents(PER_DOCUMENT)[1], documents(WHOLE, seed=1)[1]])


def _config(kind):
    return TransformerConfig(**{**BASE, **KINDS[kind], "seq_length": SEQ})


def _cp4_hierarchical(rank, world):
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.training.run.builders import context_parallel_shard

    groups = ProcessGroups(Topology.from_world_size(world, cp=world), rank,
                           hierarchical_cp=(2, 2))
    batch = _batch()
    shard = context_parallel_shard(batch, world, rank, "a2a+p2p")
    out = {}
    for kind in MODEL_KINDS:
        model = GPTModel(_config(kind), seed=7, cp_group=groups.cp_group,
                         cp_comm_type="a2a+p2p")
        loss = _loss(model, shard)
        (loss * shard["loss_mask"]).sum().backward()
        out[kind] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    return out


def test_cp4_a2a_p2p_packed_documents_give_each_documents_own_loss():
    batch = _batch()
    rows = [batch[CU_SEQLENS][i].tolist() for i in range(2)]
    assert document_split_applies(rows[0], 4, "a2a+p2p")
    assert not document_split_applies(rows[1], 4, "a2a+p2p")
    held = [[document_rank_positions(rows[0], 4, r), rank_positions(SEQ, 4, r)]
            for r in range(4)]
    per_rank = run_on_ranks(_cp4_hierarchical, 4)
    for kind in MODEL_KINDS:
        model = GPTModel(_config(kind), seed=7)
        want = torch.stack([_expected(model, documents(PER_DOCUMENT)[0]),
                            _expected(model, documents(WHOLE, seed=1)[0])]).detach()
        (_loss(model, batch) * batch["loss_mask"]).sum().backward()
        got = torch.zeros_like(want)
        for rank, result in enumerate(per_rank):
            for i in range(2):
                got[i, held[rank][i]] = result[kind][0][i]
        err = ((got - want).abs() * batch["loss_mask"]).max().item()
        assert err < 1e-5, (kind, err)
        for name, param in model.named_parameters():
            grad = sum(result[kind][1][name] for result in per_rank)
            assert torch.allclose(grad, param.grad, atol=1e-5), (kind, name)
