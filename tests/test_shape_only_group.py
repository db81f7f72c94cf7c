"""A ShapeOnlyGroup builds a layout's model without processes, and never communicates.

`gigatron plan` reads every tensor-parallel rank's parameters from GPTModel built on the
meta device over `ShapeOnlyGroup(tp, rank)`: the model must come out as it does over the
real tp group of that rank (names, shapes, split, ZeRO's tags, the rank's vocabulary slice),
and anything that would communicate over the shape-only group must raise, not hang or
silently act as tp=1.
"""
import pytest
import torch

from multirank import run_on_ranks

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel import comm
from gigatron.parallel.comm import ShapeOnlyGroup

TAGS = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
        "shared_embedding")


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                             vocab_size=100, make_vocab_size_divisible_by=8, seq_length=16,
                             **kw)


def _describe(model: torch.nn.Module):
    """Everything a layout decides about the parameters, and the rank's vocabulary slice."""
    params = [(name, tuple(p.shape), p.dtype, p.requires_grad,
               tuple(getattr(p, tag, None) for tag in TAGS))
              for name, p in model.named_parameters()]
    embedding = getattr(model, "embedding", None)
    return params, embedding.word_embeddings.vocab_start if embedding is not None else None


def _built_both_ways(rank, world, kw, pre, post):
    import torch.distributed as dist

    group = dist.new_group(list(range(world)))
    c = _config(**kw)
    real, shaped = (GPTModel(c, tp_group=g, pre_process=pre, post_process=post,
                             device=torch.device("meta"))
                    for g in (group, ShapeOnlyGroup(world, rank)))
    return _describe(real), _describe(shaped)


@pytest.mark.parametrize("kw,pre,post", [
    ({"sequence_parallel": True}, True, False),
    ({"untie_embeddings_and_output_weights": True}, True, True),
    ({}, False, True),
    ({"activation": "swiglu", "normalization": "RMSNorm", "position_embedding_type": "rope",
      "add_bias_linear": False, "num_query_groups": 2, "params_dtype": torch.bfloat16},
     True, True)])
def test_a_model_over_a_shape_only_group_equals_one_over_the_real_tp_group(kw, pre, post):
    for rank, (real, shaped) in enumerate(run_on_ranks(_built_both_ways, 2, kw, pre, post)):
        assert shaped == real, f"tp rank {rank}"


def test_the_group_gives_layers_its_size_and_rank():
    model = GPTModel(_config(), tp_group=ShapeOnlyGroup(4, 3), device=torch.device("meta"))
    assert model.embedding.word_embeddings.weight.shape == (128 // 4, 32)
    assert model.embedding.word_embeddings.vocab_start == 3 * 128 // 4
    assert model.decoder.layers["0"].mlp.linear_fc1.weight.shape == (128 // 4, 32)


@pytest.mark.parametrize("size,rank", [(0, 0), (2, 2), (2, -1)])
def test_a_bad_size_or_rank_is_refused(size, rank):
    with pytest.raises(ValueError, match="ShapeOnlyGroup"):
        ShapeOnlyGroup(size, rank)


x = torch.zeros(4)
COLLECTIVES = {
    "all_reduce": lambda g: comm.all_reduce(x, g),
    "reduce_scatter": lambda g: comm.reduce_scatter(torch.zeros(2), x, g),
    "all_gather": lambda g: comm.all_gather(torch.zeros(8), x, g),
    "all_gather_uneven": lambda g: comm.all_gather_uneven(x, g),
    "broadcast": lambda g: comm.broadcast(x, 0, g),
    "send_recv": lambda g: comm.send_recv([(x, 1)], [], g),
    "barrier": lambda g: comm.barrier(g),
}


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("op", list(COLLECTIVES))
def test_every_collective_refuses_a_shape_only_group(op, size):
    before = comm.stats.total()
    with pytest.raises(RuntimeError, match=f"{op} over ShapeOnlyGroup.*shape-only"):
        COLLECTIVES[op](ShapeOnlyGroup(size))
    assert comm.stats.total() == before


def test_a_tensor_parallel_forward_over_it_raises_instead_of_running_as_tp1():
    model = GPTModel(_config(), tp_group=ShapeOnlyGroup(2), device=torch.device("meta"))
    ids = torch.zeros(1, 16, dtype=torch.long, device="meta")
    with pytest.raises(RuntimeError, match="shape-only"):
        model(input_ids=ids)
