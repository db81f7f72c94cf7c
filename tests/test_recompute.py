"""Activation recomputation changes memory, never numbers: with dropout ON, full (uniform
and block) and selective recomputation give bit-identical losses and grads (torch.equal)
to no recomputation, because the default and tensor-parallel RNG states are replayed."""
import pytest
import torch
import torch.distributed as dist
from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.models.zoo import load_config
from gigatron.parallel.tensor import allreduce_sequence_parallel_grads

RECOMPUTE = [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
]
DROPOUT = dict(hidden_dropout=0.2, attention_dropout=0.2)


def _loss_and_grads(config, tp_group=None, steps=2):
    torch.manual_seed(7)
    model = GPTModel(config, tp_group=tp_group)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=g)
    losses = []
    for _ in range(steps):  # a second step checks the RNG streams advance identically
        loss = model(ids, labels=ids.roll(-1, dims=1)).mean()
        loss.backward()
        losses.append(loss.detach())
    allreduce_sequence_parallel_grads(model.parameters(), tp_group)
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_identical(got, ref, what):
    assert torch.equal(got[0], ref[0]), f"{what}: losses differ {got[0]} vs {ref[0]}"
    for name, grad in ref[1].items():
        assert torch.equal(got[1][name], grad), f"{what}: grad of {name} differs"


@pytest.mark.parametrize("style,backend", [("debug-gpt2", "sdpa"), ("debug-llama", "unfused")])
def test_recompute_gives_bit_identical_grads_with_dropout(style, backend):
    base = _loss_and_grads(load_config(style, attention_backend=backend, **DROPOUT))
    for knobs in RECOMPUTE:
        got = _loss_and_grads(load_config(style, attention_backend=backend, **DROPOUT, **knobs))
        _assert_identical(got, base, f"{style} {knobs}")


def test_dropout_is_actually_on_in_recompute_tests():
    on = _loss_and_grads(load_config("debug-gpt2", **DROPOUT), steps=1)
    off = _loss_and_grads(load_config("debug-gpt2", hidden_dropout=0.0, attention_dropout=0.0),
                          steps=1)
    assert not torch.equal(on[0], off[0])


def _tp_recompute(rank, world_size):
    group = dist.new_group(list(range(world_size)))
    for style in ("debug-gpt2", "debug-llama"):
        cfg = dict(sequence_parallel=True, attention_backend="unfused", **DROPOUT)
        base = _loss_and_grads(load_config(style, **cfg), group)
        for knobs in (RECOMPUTE[0], RECOMPUTE[3]):
            got = _loss_and_grads(load_config(style, **cfg, **knobs), group)
            _assert_identical(got, base, f"{style} tp={world_size} sp {knobs}")
    return True


def test_tp2_sequence_parallel_recompute_gives_bit_identical_grads_with_dropout():
    assert all(run_on_ranks(_tp_recompute, 2))


def _forward_counts(config):
    model = GPTModel(config)
    counts = {}
    for name, module in model.named_modules():
        if name.endswith("core_attention") or name.count(".") == 2 and ".layers." in name:
            counts[name] = 0
            # A pre-hook: torch's recomputation may stop a module early once it has
            # rebuilt every saved tensor backward needs, so a post-hook could miss it.
            module.register_forward_pre_hook(
                lambda m, i, n=name: counts.__setitem__(n, counts[n] + 1))
    ids = torch.zeros(1, config.seq_length, dtype=torch.long)
    model(ids, labels=ids).sum().backward()
    return counts


@pytest.mark.parametrize("knobs,recomputed", [
    (RECOMPUTE[0], {"decoder.layers.0", "decoder.layers.1",
                    "decoder.layers.0.self_attention.core_attention",
                    "decoder.layers.1.self_attention.core_attention"}),
    (RECOMPUTE[2], {"decoder.layers.0", "decoder.layers.0.self_attention.core_attention"}),
    (RECOMPUTE[3], {"decoder.layers.0.self_attention.core_attention",
                    "decoder.layers.1.self_attention.core_attention"}),
])
def test_recompute_reruns_exactly_the_chosen_modules_in_backward(knobs, recomputed):
    counts = _forward_counts(load_config("debug-gpt2", **knobs))
    rerun = {name for name, c in counts.items() if c == 2}
    assert rerun == recomputed, counts
    assert all(c in (1, 2) for c in counts.values()), counts


@pytest.mark.cuda
def test_recompute_bit_identical_on_cuda_with_dropout():
    """Same property on a GPU: the tracker and checkpoint replay the device generator.
    (unfused attention: sdpa's memory-efficient backward may use atomics.)"""
    device = torch.device("cuda")
    results = []
    for knobs in ({}, RECOMPUTE[0], RECOMPUTE[3]):
        cfg = load_config("debug-llama", attention_backend="unfused", **DROPOUT, **knobs)
        torch.manual_seed(7)
        torch.cuda.manual_seed(7)
        model = GPTModel(cfg, device=device)
        ids = torch.arange(2 * cfg.seq_length, device=device).view(2, -1) % cfg.vocab_size
        loss = model(ids, labels=ids).mean()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))
