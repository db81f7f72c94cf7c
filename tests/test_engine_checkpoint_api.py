"""DeepSpeed's checkpoint API on the layout-free engine checkpoint: the load options as
DeepSpeed documents them (load_optimizer_states, load_lr_scheduler_states,
load_module_only), `tag` and the `latest` file, load_module_strict, buffers and frozen
parameters, and per-rank checkpoints written before the torch_dist format still loading."""
import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gigatron  # noqa: F401  (imported once here: the forked ranks inherit it)
from multirank import RankError, run_on_ranks


def model(extra_layer: bool = False) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)]
    return nn.Sequential(*(layers + [nn.Linear(4, 4)] if extra_layer else layers))


def config(stage: int = 0, precision: str = "fp32", world: int = 1) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 // world,
           "steps_per_print": 1000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 50}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train(engine, steps: int, rank: int = 0, world: int = 1) -> list:
    losses = []
    accumulation = 2 // world
    for _ in range(steps):
        for j in range(accumulation):
            g = torch.Generator().manual_seed(100 * engine.global_steps + rank * accumulation + j)
            x, y = torch.randn(2, 8, generator=g), torch.randint(0, 4, (2,), generator=g)
            loss = F.cross_entropy(engine(x.to(engine.dtype)).float(), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def weights(engine) -> dict:
    return {k: v.float() for k, v in engine.module_state_dict().items()}


def masters_match_weights(engine) -> bool:
    """Each ZeRO master shard equals this rank's slice of the weights (ZeRO's internals:
    a master shard is its buckets' parameter slices, in order)."""
    for g in engine.zero.flat_groups:
        pieces = torch.cat([g.param_shard_piece(b) for b in g.buckets]).float()
        if not torch.equal(g.master.detach().float().cpu(), pieces.cpu()):
            return False
    return True


# -- load_optimizer_states / load_lr_scheduler_states / load_module_only ------------------
def _options(rank, world, folder, save_stage, load_stage, precision):
    import gigatron

    def fresh(stage):
        return gigatron.initialize(model=model(), config=config(stage, precision, world))[0]

    saved = fresh(save_stage)
    train(saved, 3, rank, world)
    saved.save_checkpoint(folder, tag="t", client_state={"epoch": 7})
    untouched_scheduler = fresh(load_stage).lr_scheduler.state_dict()
    out = {}
    for name, kwargs in [("all", {}), ("no_optimizer", {"load_optimizer_states": False}),
                         ("no_scheduler", {"load_lr_scheduler_states": False}),
                         ("module_only", {"load_module_only": True})]:
        engine = fresh(load_stage)
        _, client = engine.load_checkpoint(folder, **kwargs)
        out[name] = {
            "weights": all(torch.equal(a, b) for a, b in
                           zip(weights(engine).values(), weights(saved).values())),
            "optimizer_steps": [float(s["step"]) for s in engine.optimizer.state.values()],
            "scheduler_loaded": engine.lr_scheduler.state_dict() ==
            saved.lr_scheduler.state_dict() != untouched_scheduler,
            "scheduler_untouched": engine.lr_scheduler.state_dict() == untouched_scheduler,
            "lr": engine.get_lr() == saved.get_lr(), "global_steps": engine.global_steps,
            "masters_are_weights": masters_match_weights(engine), "client": client}
        if name != "all":  # the run goes on from what was loaded
            train(engine, 1, rank, world)
    return out


@pytest.mark.parametrize("save_stage,load_stage,precision",
                         [(1, 3, "bf16"), (3, 0, "fp32")], ids=["1to3-bf16", "3to0-fp32"])
def test_load_options_behave_as_deepspeed_documents(tmp_path, save_stage, load_stage,
                                                    precision):
    results = run_on_ranks(_options, 2, str(tmp_path), save_stage, load_stage, precision,
                           timeout=240)
    for out in results:
        every = out["all"]
        assert every["weights"] and every["optimizer_steps"] == [3.0]
        assert every["scheduler_loaded"] and every["lr"] and every["global_steps"] == 3
        assert every["client"] == {"epoch": 7}
        # DeepSpeed: the optimizer state stays this engine's (fresh: none), its fp32
        # masters are refreshed from the loaded weights; counters and scheduler load
        no_optimizer = out["no_optimizer"]
        assert no_optimizer["weights"] and no_optimizer["optimizer_steps"] == []
        assert no_optimizer["masters_are_weights"] and no_optimizer["scheduler_loaded"]
        assert no_optimizer["global_steps"] == 3
        no_scheduler = out["no_scheduler"]  # the scheduler stays this engine's
        assert no_scheduler["weights"] and no_scheduler["optimizer_steps"] == [3.0]
        assert no_scheduler["scheduler_untouched"] and no_scheduler["global_steps"] == 3
        module_only = out["module_only"]  # the weights only: counters stay 0
        assert module_only["weights"] and module_only["optimizer_steps"] == []
        assert module_only["masters_are_weights"] and module_only["scheduler_untouched"]
        assert module_only["global_steps"] == 0 and module_only["client"] == {"epoch": 7}


# -- tag and latest ------------------------------------------------------------------------
def test_tags_and_the_latest_file(tmp_path):
    import gigatron

    engine = gigatron.initialize(model=model(), config=config())[0]
    train(engine, 2)
    engine.save_checkpoint(str(tmp_path), tag="mid", client_state={"at": "mid"})
    train(engine, 1)
    assert engine.save_checkpoint(str(tmp_path)) is True  # DeepSpeed's default tag
    assert open(tmp_path / "latest").read() == "global_step3"
    engine.save_checkpoint(str(tmp_path), tag="aside", save_latest=False)
    assert open(tmp_path / "latest").read() == "global_step3"
    folder = tmp_path / "global_step3" / "iter_0000003"
    meta = json.loads((folder / "metadata.json").read_text())
    assert (meta["ckpt_format"], meta["tag"], meta["world_size"]) == ("torch_dist",
                                                                     "global_step3", 1)

    engine = gigatron.initialize(model=model(), config=config())[0]
    path, client = engine.load_checkpoint(str(tmp_path))
    assert (path, client, engine.global_steps) == (str(folder), {}, 3)
    path, client = engine.load_checkpoint(str(tmp_path), tag="mid")
    assert client == {"at": "mid"} and engine.global_steps == 2
    assert path == str(tmp_path / "mid" / "iter_0000002")
    with pytest.raises(ValueError, match="no checkpoint with tag 'nope' in"):
        engine.load_checkpoint(str(tmp_path), tag="nope")


# -- RNG states ---------------------------------------------------------------------------
def test_rng_states_continue_in_the_layout_that_saved_them(tmp_path, capsys):
    import random

    import numpy as np

    import gigatron

    engine = gigatron.initialize(model=model(), config=config())[0]
    train(engine, 1)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    engine.save_checkpoint(str(tmp_path))
    expected = (random.random(), np.random.rand(), torch.rand(()).item())
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    engine = gigatron.initialize(model=model(), config=config())[0]
    engine.load_checkpoint(str(tmp_path))
    assert (random.random(), np.random.rand(), torch.rand(()).item()) == expected
    assert "RNG states not restored" not in capsys.readouterr().out
    random.seed(2), np.random.seed(2), torch.manual_seed(2)
    engine.load_checkpoint(str(tmp_path), load_module_only=True)  # weights only
    assert random.random() != expected[0]


# -- load_module_strict --------------------------------------------------------------------
def test_other_layer_names_are_one_error_unless_not_strict(tmp_path):
    import gigatron

    saved = gigatron.initialize(model=model(), config=config())[0]
    train(saved, 1)
    saved.save_checkpoint(str(tmp_path))
    bigger = gigatron.initialize(model=model(extra_layer=True), config=config())[0]
    with pytest.raises(ValueError, match=r"lacks '3.bias', '3.weight' of this module: .*"
                                         r"pass load_module_strict=False"):
        bigger.load_checkpoint(str(tmp_path))
    smaller = gigatron.initialize(model=nn.Sequential(nn.Linear(8, 16)), config=config())[0]
    with pytest.raises(ValueError, match=r"holds '2.bias', '2.weight' that this module has "
                                         r"not"):
        smaller.load_checkpoint(str(tmp_path))
    extra_before = bigger.module[3].weight.detach().clone()
    bigger.load_checkpoint(str(tmp_path), load_module_strict=False)
    assert torch.equal(bigger.module[0].weight, saved.module[0].weight)
    assert torch.equal(bigger.module[3].weight, extra_before)  # not in the checkpoint


# -- buffers and frozen parameters ---------------------------------------------------------
def normed_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    net[0].requires_grad_(False)  # frozen: ZeRO does not hold it, the checkpoint does
    return net


def _buffers_and_frozen(rank, world, folder):
    import gigatron

    if world == 2:
        engine = gigatron.initialize(model=normed_model(0), config=config(3, world=2))[0]
        train(engine, 2, rank, world)
        engine.save_checkpoint(folder)
        return weights(engine)
    engine = gigatron.initialize(model=normed_model(1), config=config(1))[0]
    engine.load_checkpoint(folder)
    return weights(engine)


def test_buffers_and_frozen_parameters_are_saved_and_loaded(tmp_path):
    saved = run_on_ranks(_buffers_and_frozen, 2, str(tmp_path), timeout=120)
    # the ranks' batch-norm statistics differ (each its own batches); rank 0's are saved,
    # as DeepSpeed saves rank 0's module
    assert not torch.equal(saved[0]["1.running_mean"], saved[1]["1.running_mean"])
    loaded = run_on_ranks(_buffers_and_frozen, 1, str(tmp_path), timeout=120)[0]
    assert loaded.keys() == saved[0].keys()
    for name, value in saved[0].items():
        assert torch.equal(loaded[name], value), name
    assert loaded["1.num_batches_tracked"] == 2  # a 0-dim buffer: 2 forwards on rank 0


# -- per-rank checkpoints written before the torch_dist format ------------------------------
def save_per_rank_as_before(engine, save_dir: str, tag: str) -> None:
    """What engine.save_checkpoint wrote before issue 26 (commit 32c4557): one torch file
    per rank through training/checkpoint/folders.py, then `latest`."""
    import random

    import numpy as np

    from gigatron.training.checkpoint import folders as files
    from gigatron.training.checkpoint.integrity import job_gather, single_process_gather

    state = {"module": engine.module_state_dict(), "optimizer": engine.zero.state_dict(),
             "lr_scheduler": engine.lr_scheduler.state_dict(),
             "counters": {name: getattr(engine, name) for name in
                          ("global_steps", "global_samples", "micro_steps", "skipped_steps")},
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                     "torch": torch.get_rng_state()},
             "client_state": {"old": True}}
    meta = {"tag": tag, "world_size": engine.world_size, "zero_stage": engine.zero.stage,
            "ds_config": engine.config.resolved}
    gather = job_gather(engine.device) if engine.world_size > 1 else single_process_gather
    files.save_checkpoint(os.path.join(save_dir, tag), engine.global_steps, state,
                          {"tp": 0, "pp": 0, "dp": engine.global_rank}, meta, gather,
                          engine.global_rank == 0)
    if engine.global_rank == 0:
        files.atomic_write_text(os.path.join(save_dir, "latest"), tag)
    gather([0])


def _old_format(rank, world, folder):
    import gigatron

    def fresh():
        return gigatron.initialize(model=model(), config=config(2, world=world))[0]

    if world == 1:  # the 2-rank per-rank checkpoint, on 1 rank
        engine = fresh()
        try:
            engine.load_checkpoint(folder)
        except ValueError as err:
            message = str(err)
        engine.load_checkpoint(folder, load_optimizer_states=False)
        return message, weights(engine), engine.global_steps
    straight = train(fresh(), 4, rank, world)
    engine = fresh()
    first = train(engine, 2, rank, world)
    save_per_rank_as_before(engine, folder, "old")
    saved = weights(engine)
    engine = fresh()
    _, client = engine.load_checkpoint(folder)
    rest = train(engine, 2, rank, world)
    return first + rest == straight, client, saved


def test_per_rank_checkpoints_written_before_still_load(tmp_path):
    results = run_on_ranks(_old_format, 2, str(tmp_path), timeout=120)
    for exact, client, _ in results:
        assert exact and client == {"old": True}  # the same layout: bit for bit
    assert not os.path.exists(tmp_path / "old" / "iter_0000002" / ".metadata")
    message, loaded, steps = run_on_ranks(_old_format, 1, str(tmp_path), timeout=120)[0]
    assert "per-rank checkpoint saved by 2 ranks, this run has 1" in message
    assert "load_optimizer_states=False" in message
    assert all(torch.equal(loaded[k], v) for k, v in results[0][2].items()) and steps == 2


def test_a_failed_load_stops_every_rank(tmp_path):
    """A damaged file seen by one rank: every rank raises (none waits in a collective)."""
    run_on_ranks(_save_two, 2, str(tmp_path), timeout=120)
    folder = tmp_path / "global_step1" / "iter_0000001"
    victim = sorted(p for p in os.listdir(folder) if p.endswith(".distcp"))[-1]
    with open(folder / victim, "r+b") as f:
        f.seek(10)
        f.write(b"\x00garbage")
    with pytest.raises(RankError) as failed:
        run_on_ranks(_load_two, 2, str(tmp_path), timeout=120)
    text = str(failed.value)
    assert f"{victim} of iteration 1 does not match the checksum" in text
    assert "could not load its part of checkpoint" in text  # the other rank's line


def _save_two(rank, world, folder):
    import gigatron

    engine = gigatron.initialize(model=model(), config=config(1, world=world))[0]
    train(engine, 1, rank, world)
    engine.save_checkpoint(folder)


def _load_two(rank, world, folder):
    import gigatron

    engine = gigatron.initialize(model=model(), config=config(1, world=world))[0]
    engine.load_checkpoint(folder)
