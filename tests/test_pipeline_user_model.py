"""gigatron.pipe: a user's own transformer (tests/pipe_user_model.py, tied embeddings through
TiedLayerSpec, tuples of float and int64 tensors between stages) trained through
PipelineModule + gigatron.initialize + train_batch equals the single-process run step by
step: pp=2 and pp=2 x dp=2 (ZeRO 1, 2), 1F1B and interleaved, on forked gloo ranks.

Tolerance fp32 1e-5 (relative, 1e-6 absolute) on every step's loss and every final
parameter, compared by layout-free name ("3.fc1.weight", "tied_modules.embed.weight").
The reference is one process (PipelineModule with num_stages=1), itself checked against a
plain torch loop. AdamW: a wrongly scaled, averaged or unsummed gradient changes the update.
"""
import functools
import os
import subprocess
import sys

import pytest
import torch

import pipe_user_model as um
from multirank import run_on_ranks

MICRO, GLOBAL_MICRO = 2, 8  # micro-batches per step over all replicas
# The runs compared with the single process train 2 steps: AdamW's second update weighs the
# two steps' gradients against each other, so a gradient of the wrong size shows from the
# second; a third step cost ~1/5 of the file's CPU. STEPS: tests/test_pipe_zero_bubble.py's.
TRAINED, STEPS = 2, 3
RTOL, ATOL = 1e-5, 1e-6
TIED = "tied_modules.embed.weight"


def config(gas, zero=0, **extra):
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": zero}, "steps_per_print": 1000, **extra}


def train(rank, world, pp, virtual=1, zero=0, dropout=0.0, interval=0, steps=TRAINED):
    """Per-step losses, this rank's final parameters by name and the tied weight's copy."""
    import gigatron
    from gigatron.pipe import PipelineModule

    net = PipelineModule(um.layers(dropout=dropout), num_stages=pp, loss_fn=um.loss_fn,
                         seed_layers=True, virtual_stages=virtual,
                         activation_checkpoint_interval=interval)
    gas = GLOBAL_MICRO // net.dp_size
    engine, _, _, _ = gigatron.initialize(model=net, config=config(gas, zero))
    losses = []
    for step in range(steps):
        batches = [um.micro_batch(step, net.dp_rank * gas + j) for j in range(gas)]
        losses.append(float(engine.train_batch(iter(batches))))
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}


@functools.lru_cache(maxsize=None)
def reference(dropout=0.0):
    return run_on_ranks(train, 1, 1, dropout=dropout)[0]


def assert_matches_reference(results, dropout=0.0):
    ref_losses, ref_params = reference(dropout)
    seen = set()
    for losses, params in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses),
                                   rtol=RTOL, atol=ATOL)
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
            seen.add(name)
    assert seen == set(ref_params)  # the stages together hold the whole model


def test_single_process_engine_equals_a_plain_torch_loop():
    losses, params = reference()
    model = um.PlainModel()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    expected = []
    for step in range(TRAINED):
        total = 0.0
        for j in range(GLOBAL_MICRO):
            ids, labels = um.micro_batch(step, j)
            loss = um.loss_fn(model(ids), labels)
            (loss / GLOBAL_MICRO).backward()
            total += loss.item() / GLOBAL_MICRO
        optimizer.step()
        optimizer.zero_grad()
        expected.append(total)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL,
                               atol=ATOL)
    torch.testing.assert_close(params[TIED], model.embed.weight.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(params["4.fc2.weight"], model.blocks[3].fc2.weight.detach(),
                               rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("virtual", [1, 2], ids=["1f1b", "interleaved"])
def test_pp2_matches_single_process(virtual):
    results = run_on_ranks(train, 2, 2, virtual)
    assert_matches_reference(results)
    # the tied embedding: one copy per end stage, identical after training
    torch.testing.assert_close(results[0][1][TIED], results[1][1][TIED], rtol=0, atol=0)


@pytest.mark.parametrize("virtual,zero", [(1, 1), (2, 1), (2, 2)],
                         ids=["1f1b-zero1", "interleaved-zero1", "interleaved-zero2"])
def test_pp2_dp2_matches_single_process(virtual, zero):
    assert_matches_reference(run_on_ranks(train, 4, 2, virtual, zero, timeout=180))


def test_activation_checkpointing_and_seeded_dropout_match_single_process():
    """seed_layers reseeds every layer's forward (DeepSpeed's formula): dropout masks do not
    depend on the layout, and recomputation in backward replays them."""
    results = run_on_ranks(train, 2, 2, 1, 0, 0.1, 1)
    assert_matches_reference(results, dropout=0.1)
    assert reference(0.1)[0] != reference()[0]  # dropout did act


def _tied_grads(rank, world):
    """One SGD step (lr 1, ZeRO 0) on one micro-batch: the tied weight's change is minus
    its gradient, on each end stage."""
    import gigatron
    from gigatron.pipe import PipelineModule

    net = PipelineModule(um.layers(), num_stages=world, loss_fn=um.loss_fn, seed_layers=True)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    engine, _, _, _ = gigatron.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 1.0}}})
    engine.train_batch(iter([um.micro_batch(0, 0)]))
    return {k: before[k] - v for k, v in net.state_dict().items() if k == TIED}


def test_tied_embedding_gradients_are_summed_over_first_and_last_stage():
    grads = run_on_ranks(_tied_grads, 2)
    model = um.PlainModel()
    ids, labels = um.micro_batch(0, 0)
    um.loss_fn(model(ids), labels).backward()
    full = model.embed.weight.grad
    for rank in range(2):
        torch.testing.assert_close(grads[rank][TIED], full, rtol=RTOL, atol=ATOL)
    # both uses contribute: the input side alone is a different gradient
    model.zero_grad()
    x = model.embed(ids)
    for block in model.blocks:
        x = block(x)
    out = model.norm(x[0]) @ model.embed.weight.detach().t()
    um.loss_fn(out, labels).backward()
    assert (model.embed.weight.grad - full).abs().max() > 1e-3


def _with_loader(rank, world):
    """pp2 x dp2 fed by training_data: each replica reads its share of the dataset."""
    import gigatron
    from gigatron.engine.deepspeed.data_loader import EngineDataLoader
    from gigatron.pipe import PipelineModule

    pairs = [um.micro_batch(0, i, 1) for i in range(32)]
    dataset = [(ids[0], labels[0]) for ids, labels in pairs]
    net = PipelineModule(um.layers(), num_stages=2, loss_fn=um.loss_fn, seed_layers=True)
    engine, _, loader, _ = gigatron.initialize(model=net, config=config(4, 1),
                                               training_data=dataset)
    losses = [float(engine.train_batch()) for _ in range(2)]
    shards = [list(EngineDataLoader(dataset, MICRO, d, 2)) for d in range(2)]
    return losses, len(loader), shards


def _from_shards(rank, world, shards):
    import gigatron
    from gigatron.pipe import PipelineModule

    net = PipelineModule(um.layers(), num_stages=1, loss_fn=um.loss_fn, seed_layers=True)
    engine, _, _, _ = gigatron.initialize(model=net, config=config(8, 0))
    return [float(engine.train_batch(iter(shards[0][4 * s:4 * s + 4] + shards[1][4 * s:4 * s + 4])))
            for s in range(2)]


def test_training_data_is_read_per_data_parallel_replica():
    results = run_on_ranks(_with_loader, 4, timeout=180)
    losses, length, shards = results[0]
    assert length == 8  # 32 samples / 2 replicas / micro-batch 2
    expected = run_on_ranks(_from_shards, 1, shards)[0]
    for rank_losses, _, _ in results:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(expected),
                                   rtol=RTOL, atol=ATOL)


def _eval_and_checkpoint(rank, world, folder):
    import gigatron
    from gigatron.pipe import PipelineModule

    def engine_():
        net = PipelineModule(um.layers(), num_stages=2, loss_fn=um.loss_fn, seed_layers=True,
                             virtual_stages=2)
        return gigatron.initialize(model=net, config=config(GLOBAL_MICRO))[0]

    def batches(step):
        return iter([um.micro_batch(step, j) for j in range(GLOBAL_MICRO)])

    engine = engine_()
    evaluated = float(engine.eval_batch(batches(0)))
    last_only = engine.eval_batch(batches(0), bcast_loss=False)
    straight = [float(engine.train_batch(batches(s))) for s in range(3)]
    engine = engine_()
    engine.train_batch(batches(0))
    engine.save_checkpoint(folder)
    engine = engine_()
    engine.load_checkpoint(folder)
    resumed = [float(engine.train_batch(batches(s))) for s in (1, 2)]
    return evaluated, last_only, straight, resumed, engine.global_steps


def test_eval_batch_and_checkpoint_resume(tmp_path):
    results = run_on_ranks(_eval_and_checkpoint, 2, str(tmp_path), timeout=180)
    ref_first = reference()[0][0]
    for rank, (evaluated, last_only, straight, resumed, steps) in enumerate(results):
        # the first step's loss is the untrained model's: eval_batch computes it too
        torch.testing.assert_close(evaluated, ref_first, rtol=RTOL, atol=ATOL)
        assert (last_only is None) == (rank == 0)
        assert straight[1:] == resumed and steps == 3  # bit for bit


BUILT = []  # (layer index, device type) of every Recorded layer constructed in this process


class Recorded(torch.nn.Linear):
    def __init__(self, index, size):
        super().__init__(size, size)
        BUILT.append((index, self.weight.device.type))


def _builds(rank, world):
    from gigatron.pipe import LayerSpec, PipelineModule

    BUILT.clear()
    net = PipelineModule([LayerSpec(Recorded, i, 4) for i in range(6)], num_stages=world,
                         partition_method="uniform", loss_fn=lambda out, labels: out.sum())
    return sorted(i for i, device in BUILT if device != "meta"), sorted(
        int(name) for name, _ in net.named_children() if name.isdigit())


def test_a_stage_builds_only_its_own_layers():
    """Only the stage's layers are built for real (the others, for counting their
    parameters, on the meta device): no rank ever holds the whole model."""
    assert run_on_ranks(_builds, 2) == [([0, 1, 2], [0, 1, 2]), ([3, 4, 5], [3, 4, 5])]


def test_a_layer_swapped_after_construction_is_the_one_that_runs():
    """parallelize() swaps modules inside the PipelineModule: its stages follow."""
    from gigatron.pipe import LayerSpec, PipelineModule

    net = PipelineModule([LayerSpec(torch.nn.Linear, 3, 3), LayerSpec(torch.nn.Linear, 3, 3)],
                         num_stages=1)
    x = torch.randn(2, 3)
    replacement = torch.nn.Linear(3, 3)
    net.add_module("1", replacement)
    assert torch.equal(net.chunks[0](hidden_states=x), replacement(net._modules["0"](x)))
    assert any(p is replacement.weight for p in net.chunks[0].parameters())
