"""The engine's checkpoints are layout-free: saved on 2 ranks at ZeRO stage 0, 1, 2 or 3, a
checkpoint loads on 1 rank (and a 1-rank one on 2) and the run continues with the losses of
the uninterrupted 2-rank run, the global batch kept by gradient accumulation (2 ranks x 1
micro-batch = 1 rank x 2). Also across stages (saved at s, loaded at 3 - s), in bf16 (fp32
masters) and fp16 (the dynamic loss scale carries over), and with DeepSpeed's Muon ("muon":
fp32; its momentum of matrices cut differently by the shards of each layout).

Tolerance on each step's loss: fp32 1e-5 relative (1e-6 absolute), bf16 and fp16 1e-3
(1e-4): the two layouts sum the same gradients in another order (an all-reduce over ranks
against accumulation on one), so the continuation is the uninterrupted run's to rounding
(a 16-bit gradient's last bit moves an Adam step, not the loss, at lr 1e-3); here it is bit
for bit (halving two micro-batches' gradients is exact either way). A lost optimizer state
moves the next losses by more than 1e-3. The part before the save is the reference's bit
for bit (the same layout).

Three forked jobs serve every case: 2 ranks train the reference and save; 1 rank loads and
continues, and saves its own; 2 ranks load that and continue.
"""
import contextlib
import io
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gigatron  # noqa: F401  (imported once here: the forked ranks inherit it)
from multirank import run_on_ranks

MICRO, GLOBAL_MICRO, STEPS, SAVED_AT = 2, 2, 6, 3
# (name, ZeRO stage, precision)
CASES = [("stage0", 0, "fp32"), ("stage1", 1, "fp32"), ("stage2", 2, "fp32"),
         ("stage3", 3, "fp32"), ("bf16", 2, "bf16"), ("fp16", 1, "fp16"),
         ("muon", 1, "muon")]
TOLERANCE = {"fp32": dict(rtol=1e-5, atol=1e-6), "bf16": dict(rtol=1e-3, atol=1e-4),
             "fp16": dict(rtol=1e-3, atol=1e-4), "muon": dict(rtol=1e-5, atol=1e-6)}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def engine_for(stage: int, precision: str, world: int):
    import gigatron

    config = {"train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": GLOBAL_MICRO // world, "steps_per_print": 1000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "scheduler": {"type": "WarmupDecayLR",
                            "params": {"total_num_steps": 10, "warmup_num_steps": 2}},
              # small buckets: ZeRO's shards cut parameters in the middle
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 50}}
    if precision == "muon":
        config["optimizer"] = {"type": "Muon", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":  # the scale doubles every 2 steps: it has moved by the save
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}
    return gigatron.initialize(model=model(), config=config)[0]


def micro_batch(step: int, index: int):
    """Micro-batch `index` of the global batch of `step`, whatever the layout."""
    g = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(MICRO, 8, generator=g), torch.randint(0, 4, (MICRO,), generator=g)


def train(engine, rank: int, world: int, upto: int):
    """Each step's mean loss over its micro-batches, on every rank (mean over ranks)."""
    accumulation = GLOBAL_MICRO // world
    losses = []
    while engine.global_steps < upto:
        total = torch.zeros((), dtype=torch.float64)
        for j in range(accumulation):
            x, y = micro_batch(engine.global_steps, rank * accumulation + j)
            loss = F.cross_entropy(engine(x.to(engine.dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        if world > 1:
            torch.distributed.all_reduce(total)
        losses.append(total.item() / GLOBAL_MICRO)
    return losses


def _save_on_two(rank, world, folder):
    out = {}
    for name, stage, precision in CASES:
        reference = train(engine_for(stage, precision, world), rank, world, STEPS)
        engine = engine_for(stage, precision, world)
        first = train(engine, rank, world, SAVED_AT)
        engine.save_checkpoint(os.path.join(folder, "two", name))
        out[name] = (reference, first, engine.loss_scale, engine.get_lr())
    return out


def _load_on_one(rank, world, folder):
    out = {}
    for name, stage, precision in CASES:
        continued = {}
        for load_stage in sorted({stage, 3 - stage}):
            engine = engine_for(load_stage, precision, world)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                engine.load_checkpoint(os.path.join(folder, "two", name))
            out["rng note"] = printed.getvalue()
            state = (engine.global_steps, engine.micro_steps, engine.loss_scale,
                     engine.get_lr())
            continued[load_stage] = (state, train(engine, rank, world, STEPS))
        engine = engine_for(stage, precision, world)
        train(engine, rank, world, SAVED_AT)
        engine.save_checkpoint(os.path.join(folder, "one", name))
        out[name] = continued
    return out


def _load_on_two(rank, world, folder):
    out = {}
    for name, stage, precision in CASES:
        engine = engine_for(stage, precision, world)
        engine.load_checkpoint(os.path.join(folder, "one", name))
        out[name] = ((engine.global_steps, engine.micro_steps),
                     train(engine, rank, world, STEPS))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("engine_checkpoints"))
    two = run_on_ranks(_save_on_two, 2, folder, timeout=300)
    one = run_on_ranks(_load_on_one, 1, folder, timeout=300)
    back = run_on_ranks(_load_on_two, 2, folder, timeout=300)
    return two, one[0], back


@pytest.mark.parametrize("name,stage,precision", CASES, ids=[c[0] for c in CASES])
def test_saved_on_two_ranks_continues_on_one_with_the_same_losses(runs, name, stage,
                                                                  precision):
    two, one, _ = runs
    reference, first, saved_scale, saved_lr = two[0][name]
    assert two[1][name] == two[0][name]  # every rank reports the same mean losses
    assert first == reference[:SAVED_AT]  # bit for bit before the save
    # each rank's generators are its own: not restored into another world size
    assert "RNG states not restored: " in one["rng note"]
    assert "was saved by 2 ranks (tp 1, pp 1, dp 2), this run has 1 rank (tp 1, pp 1, dp 1)" \
        in one["rng note"]
    for load_stage, (state, continued) in one[name].items():
        steps, micro_steps, scale, lr = state
        assert (steps, micro_steps) == (SAVED_AT, SAVED_AT * GLOBAL_MICRO), load_stage
        assert scale == saved_scale and (precision != "fp16" or scale != 2.0 ** 8)
        assert lr == saved_lr  # the optimizer's param groups are restored too
        torch.testing.assert_close(torch.tensor(continued),
                                   torch.tensor(reference[SAVED_AT:]), **TOLERANCE[precision],
                                   msg=lambda m: f"loaded at ZeRO stage {load_stage}: {m}")


@pytest.mark.parametrize("name,stage,precision", CASES, ids=[c[0] for c in CASES])
def test_saved_on_one_rank_continues_on_two_with_the_same_losses(runs, name, stage,
                                                                 precision):
    two, _, back = runs
    reference = two[0][name][0]
    for (steps, micro_steps), continued in (back[0][name], back[1][name]):
        assert (steps, micro_steps) == (SAVED_AT, SAVED_AT)  # 1 micro-batch per step now
        torch.testing.assert_close(torch.tensor(continued),
                                   torch.tensor(reference[SAVED_AT:]), **TOLERANCE[precision])
