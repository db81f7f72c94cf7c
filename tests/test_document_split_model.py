"""GPTModel under the per-document context-parallel split: packed documents whose lengths all
divide by 2 x cp are sharded per document (training/run/builders.py's context_parallel_shard,
split.py's rule), and the per-token losses and parameter grads at cp2 with p2p and all_gather
equal one rank's (fp32, 1e-5; forked gloo ranks); under p2p also with gpt-oss's sliding
window with sinks and with multi-latent attention."""
import torch

from gigatron.data.documents import CU_SEQLENS
from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel.context.split import document_rank_positions, split_documents_for_rank
from multirank import run_on_ranks
from test_packed_documents import BASE, KINDS, _loss, documents, packed_batch

# (comm type, attention kind); a2a: tests/test_document_split_attention.py
CASES = (("p2p", "plain"), ("all_gather", "plain"), ("p2p", "band"), ("p2p", "mla"))


def _batch():
    return packed_batch([documents((12, 4))[1], documents((4, 8, 4), seed=1)[1]])


def _cp_run(rank, cp):
    from gigatron.training.run.builders import context_parallel_shard

    batch = _batch()
    out = {}
    for comm_type, kind in CASES:
        model = GPTModel(TransformerConfig(**{**BASE, **KINDS[kind]}), seed=7,
                         cp_group=torch.distributed.group.WORLD, cp_comm_type=comm_type)
        shard = context_parallel_shard(batch, cp, rank, comm_type)
        for i in range(2):  # each sample split per document
            assert torch.equal(shard["position_ids"][i], split_documents_for_rank(
                batch["position_ids"][i], batch[CU_SEQLENS][i].tolist(), cp, rank, 0))
        loss = _loss(model, shard)
        (loss * shard["loss_mask"]).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        out[comm_type, kind] = loss.detach(), grads
    return out


def test_cp2_per_document_split_trains_as_one_rank():
    per_rank = run_on_ranks(_cp_run, 2)
    batch = _batch()
    rows = [batch[CU_SEQLENS][i].tolist() for i in range(2)]
    for case in CASES:
        model = GPTModel(TransformerConfig(**{**BASE, **KINDS[case[1]]}), seed=7)
        want = _loss(model, batch)
        (want * batch["loss_mask"]).sum().backward()
        got = torch.zeros_like(want)
        for rank, result in enumerate(per_rank):
            for i, row in enumerate(rows):
                got[i, document_rank_positions(row, 2, rank)] = result[case][0][i]
        err = ((got - want).abs() * batch["loss_mask"]).max().item()
        assert err < 1e-5, (case, err)
        for name, param in model.named_parameters():
            grad = sum(result[case][1][name] for result in per_rank)
            assert torch.allclose(grad, param.grad, atol=1e-5), (case, name)


def test_the_run_says_which_split_it_uses(capsys):
    from gigatron.training.run.builders import _say_split

    _say_split(_batch()[CU_SEQLENS], 2, 0, "p2p")
    _say_split(packed_batch([documents((7, 9))[1]])[CU_SEQLENS], 2, 0, "p2p")
    _say_split(_batch()[CU_SEQLENS], 2, 0, "a2a+p2p")  # per document too (hierarchical)
    _say_split(packed_batch([documents((12, 4))[1], documents((7, 9))[1]])[CU_SEQLENS], 2, 0,
               "p2p")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(": ")[1].split(" (")[0].split(" for ")[0] for line in lines] == [
        "per document", "of the whole sequence", "per document", "per document"]
    assert "of the whole sequence for the others" in lines[3]


def test_a_run_says_its_split_once_over_training_and_evaluations(capsys):
    """Each evaluation starts a new data iterator; the run still says its split once, and
    says the fallback (the whole-sequence split) when a conversation is no multiple of 2cp."""
    from types import SimpleNamespace

    import numpy as np

    from gigatron.data.builder import GPTDataConfig
    from gigatron.data.sft.dataset import SFTDataset
    from gigatron.training.run.builders import micro_batches

    def said(n, pad_multiple):
        conv = (np.arange(1, n + 1, dtype=np.int64), np.arange(n) % 2 == 0)
        dataset = SFTDataset([[conv, conv]], 4, 24, 0, 0, "c.jsonl", pad_multiple=pad_multiple)
        run = SimpleNamespace(data=GPTDataConfig(seq_length=24, sft=True),
                              train=SimpleNamespace(micro_batch_size=2, num_workers=0, seed=1),
                              parallel=SimpleNamespace(dp=1, context_parallel_size=2,
                                                        cp_comm_type="a2a+p2p"))
        stage = SimpleNamespace(needs_inputs=True, needs_labels=True, mtp=False)
        for _ in range(3):  # training, then two evaluations
            next(iter(micro_batches(run, dataset, 0, 0, torch.device("cpu"), stage)))
        return [line for line in capsys.readouterr().out.splitlines()
                if line.startswith("context parallel split")]

    padded, fallback = said(8, 4), said(8, 1)  # 9 tokens with the eod: padded to 12, or not
    assert len(padded) == 1 and ": per document (" in padded[0]
    assert len(fallback) == 1 and ": of the whole sequence (" in fallback[0]
