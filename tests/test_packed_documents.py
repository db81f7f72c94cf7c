"""A packed sample of documents gives each document's own loss: GPTModel's per-token loss on
one sample holding two documents (data/documents.py's cu_seqlens and restarted positions)
equals the loss of each document run alone, same weights, within 1e-5 -- on one rank (plain
attention, SDPA and the unfused softmax; a sliding window with sinks; multi-latent attention;
full and selective recomputation, gradients too), under cp2 with each --cp-comm-type, and
under tp2 (sequence parallel) x pp2 through the pipeline's own chunk inputs. Without the
boundaries (one causal stream) the second document's loss differs.
"""
import numpy as np
import pytest
import torch

from gigatron.data.documents import CU_SEQLENS, gpt_sample
from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.pipeline_chunks import GPTMicroBatchStep
from multirank import run_on_ranks

EOD, VOCAB, LENGTHS = 63, 64, (7, 9)  # two documents; a second sample with three
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
            kv_channels=8, vocab_size=VOCAB, seq_length=16, ffn_hidden_size=48,
            position_embedding_type="rope", normalization="RMSNorm", hidden_dropout=0.0,
            attention_dropout=0.0, add_bias_linear=False, init_method_std=0.1)
KINDS = {
    "plain": {},
    "unfused": {"attention_backend": "unfused"},
    "band": dict(window_size=(2, 0), window_attn_skip_freq=2, softmax_type="learnable"),
    "mla": dict(multi_latent_attention=True, q_lora_rank=None, kv_lora_rank=16,
                qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=8, num_query_groups=4),
    "recompute_full": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "recompute_selective": dict(recompute_granularity="selective"),
}


def documents(lengths=LENGTHS, seed=0):
    """Documents of these lengths, each ending in eod, and the tokens that follow the last."""
    gen = np.random.default_rng(seed)
    docs = [np.append(gen.integers(0, EOD, n - 1), EOD) for n in lengths]
    return docs, np.concatenate(docs + [[5]])


def packed_batch(samples, resets=True):
    """The collated micro-batch (torch) of gpt_sample over each sample's tokens."""
    rows = [gpt_sample(tokens, EOD, True, resets, resets) for tokens in samples]
    batch = {key: torch.as_tensor(np.stack([r[key] for r in rows])) for key in rows[0]}
    return {"input_ids": batch.pop("tokens"), **batch}


def _loss(model, batch, **extra):
    kwargs = {k: batch[k] for k in ("input_ids", "labels", "position_ids", CU_SEQLENS)
              if k in batch}
    return model(**kwargs, **extra)


def alone(model, doc):
    """The per-token loss of one document run alone (its eod's label masked anyway)."""
    tokens = np.append(doc, 5)
    return _loss(model, packed_batch([tokens], resets=False))[0]


def _expected(model, docs):
    return torch.cat([alone(model, d) for d in docs])


@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_documents_give_each_documents_own_loss(kind):
    model = GPTModel(TransformerConfig(**{**BASE, **KINDS[kind]}), seed=7)
    docs, tokens = documents()
    docs3, tokens3 = documents((3, 6, 7), seed=1)
    batch = packed_batch([tokens, tokens3])  # samples with different documents
    loss = _loss(model, batch)
    mask = batch["loss_mask"]
    for row, ds in ((0, docs), (1, docs3)):
        want = _expected(model, ds)
        assert ((loss[row] - want).abs() * mask[row]).max() < 1e-5, kind
    if kind.startswith("recompute") or kind in ("band", "mla"):
        # gradients through the recomputation (and the sinks) equal the documents' alone
        model.zero_grad()
        (loss * mask).sum().backward()
        packed = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad()
        for ds in (docs, docs3):
            for d in ds:
                (alone(model, d)[:-1]).sum().backward()
        for name, param in model.named_parameters():
            assert torch.allclose(packed[name], param.grad, atol=1e-5), (kind, name)
    stream = _loss(model, packed_batch([tokens, tokens3], resets=False))
    assert (stream[0, LENGTHS[0]:] - loss[0, LENGTHS[0]:]).abs().max() > 1e-3


def _cp_losses(rank, cp, comm_types):
    from gigatron.parallel.context.split import split_for_rank
    from gigatron.training.run.builders import context_parallel_shard

    docs, tokens = documents()
    batch = packed_batch([tokens, documents((3, 6, 7), seed=1)[1]])
    out = {}
    for comm_type in comm_types:
        model = GPTModel(TransformerConfig(**BASE), seed=7, cp_group=torch.distributed.group.WORLD,
                         cp_comm_type=comm_type)
        shard = context_parallel_shard(batch, cp, rank)
        assert torch.equal(shard[CU_SEQLENS], batch[CU_SEQLENS])  # whole on every cp rank
        assert torch.equal(shard["position_ids"], split_for_rank(batch["position_ids"], cp,
                                                                 rank, 1))
        out[comm_type] = _loss(model, shard).detach()
    return out


def test_context_parallel_packed_documents_equal_each_document_alone():
    from gigatron.parallel.context.split import restore_sequence

    comm_types = ("p2p", "all_gather", "a2a")
    per_rank = run_on_ranks(_cp_losses, 2, comm_types)
    model = GPTModel(TransformerConfig(**BASE), seed=7)
    docs, tokens = documents()
    docs3, tokens3 = documents((3, 6, 7), seed=1)
    batch = packed_batch([tokens, tokens3])
    want = torch.stack([_expected(model, docs), _expected(model, docs3)]).detach()
    for comm_type in comm_types:
        got = restore_sequence([r[comm_type] for r in per_rank], seq_dim=1)
        err = ((got - want).abs() * batch["loss_mask"]).max().item()
        assert err < 1e-5, (comm_type, err)


def _tp2_pp2_losses(rank, world):
    import torch.distributed as dist

    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    stage, tp_group = rank // 2, tp_groups[rank // 2]
    config = TransformerConfig(**{**BASE, "sequence_parallel": True})
    model = GPTModel(config, tp_group=tp_group, pre_process=stage == 0,
                     post_process=stage == 1, layer_range=[stage], seed=7)
    docs, tokens = documents()
    batch = packed_batch([tokens, documents((3, 6, 7), seed=1)[1]])
    if stage == 1:  # the last stage reads no input ids: what the data loader gives it
        batch = {k: v for k, v in batch.items() if k != "input_ids"}
    step = GPTMicroBatchStep()
    if stage == 0:
        hidden = model(**step.chunk_inputs(batch, None, last=False))
        dist.send(hidden.contiguous(), rank + 2)
        return None
    received = torch.empty(16 // 2, 2, 32)
    dist.recv(received, rank - 2)
    return model(**step.chunk_inputs(batch, received, last=True)).detach()


def test_tp2_pp2_packed_documents_equal_each_document_alone():
    per_rank = run_on_ranks(_tp2_pp2_losses, 4)
    model = GPTModel(TransformerConfig(**BASE), seed=7)
    docs, tokens = documents()
    docs3, tokens3 = documents((3, 6, 7), seed=1)
    batch = packed_batch([tokens, tokens3])
    want = torch.stack([_expected(model, docs), _expected(model, docs3)]).detach()
    for got in per_rank[2:]:
        err = ((got - want).abs() * batch["loss_mask"]).max().item()
        assert err < 1e-5, err
