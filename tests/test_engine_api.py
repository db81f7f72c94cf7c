"""The engine's API as DeepSpeed users call it: accessors, args, the data loader, fp16
overflow, exact resume, and one clear line for each misuse."""
import argparse
import json
import os
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from multirank import RankError, run_on_ranks


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def config(**extra) -> dict:
    base = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}, "steps_per_print": 1000}
    base.update(extra)
    return base


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 64) -> None:
        g = torch.Generator().manual_seed(3)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _train(engine, loader, steps):
    losses, it = [], iter(loader)
    while engine.global_steps < steps:
        x, y = next(it)
        loss = F.cross_entropy(engine(x.to(engine.device)), y.to(engine.device))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_accessors_args_and_loader_as_deepspeed_names_them(tmp_path):
    import gigatron

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config()))
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # as DeepSpeed's tutorials do
    args = gigatron.add_config_arguments(parser).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    net = model()
    engine, optimizer, loader, scheduler = gigatron.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=Pairs())
    assert engine.module is net and engine.training_dataloader is loader and scheduler is None
    assert isinstance(optimizer, torch.optim.Optimizer)
    assert (engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(),
            engine.gradient_accumulation_steps()) == (8, 2, 4)
    assert (engine.global_rank, engine.world_size, engine.local_rank) == (0, 1, 0)
    assert engine.device == torch.device("cpu") and engine.dtype == torch.float32
    assert not engine.fp16_enabled() and not engine.bfloat16_enabled()
    assert len(loader) == 32  # 64 samples / micro-batch 2 on one rank
    assert [engine.is_gradient_accumulation_boundary() for _ in range(1)] == [False]
    _train(engine, loader, 2)
    assert engine.global_steps == 2 and engine.micro_steps == 8
    assert engine.get_lr() == [1e-2] * len(optimizer.param_groups)
    assert engine.get_global_grad_norm() > 0
    names = [n for n, _ in engine.named_parameters()]
    assert names[0] == "module.0.weight"  # DeepSpeed's engine is an nn.Module holding `module`
    engine.eval()
    assert not net.training


def test_save_load_and_continue_is_bit_exact(tmp_path):
    import gigatron

    def fresh():
        return gigatron.initialize(model=model(), training_data=Pairs(), config=config(
            scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}}))

    engine, _, loader, _ = fresh()
    torch.manual_seed(5)
    straight = _train(engine, loader, 6)
    engine, _, loader, _ = fresh()
    torch.manual_seed(5)
    first = _train(engine, loader, 3)
    engine.save_checkpoint(str(tmp_path), client_state={"note": "kept"})
    assert open(tmp_path / "latest").read().strip() == "global_step3"
    engine, _, loader, _ = fresh()
    path, client = engine.load_checkpoint(str(tmp_path))
    assert client == {"note": "kept"} and path.startswith(str(tmp_path / "global_step3"))
    assert engine.global_steps == 3
    loader.epoch = 0  # the loader replays the same pass (its position is the script's)
    it = iter(loader)
    for _ in range(12):
        next(it)
    rest = []
    while engine.global_steps < 6:
        x, y = next(it)
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        rest.append(loss.item())
    assert first + rest == straight  # bit for bit


def test_no_checkpoint_returns_none_none(tmp_path):
    import gigatron

    engine, _, _, _ = gigatron.initialize(model=model(), config=config())
    assert engine.load_checkpoint(str(tmp_path)) == (None, None)


def _fp16_overflow(rank, world):
    import gigatron

    net = model()
    engine, _, _, _ = gigatron.initialize(model=net, config=config(
        train_batch_size=2 * world, fp16={"enabled": True, "initial_scale_power": 8,
                                          "hysteresis": 1}, zero_optimization={"stage": 2}))
    x, y = torch.randn(2, 8).half(), torch.randint(0, 4, (2,))
    if rank == 0:
        net[0].weight.register_hook(lambda g: g * float("inf"))  # one rank overflows
    loss = F.cross_entropy(engine(x).float(), y)
    engine.backward(loss)
    engine.step()
    return engine.skipped_steps, engine.loss_scale, engine.global_steps


def test_fp16_overflow_on_one_rank_skips_the_step_everywhere_and_backs_off():
    results = run_on_ranks(_fp16_overflow, 2, timeout=60)
    assert results == [(1, 128.0, 1)] * 2  # 2**8 halved (hysteresis 1), step counted


def test_misuse_is_one_clear_line(tmp_path):
    import gigatron

    with pytest.raises(ValueError, match="has no trainable parameters"):
        gigatron.initialize(model=nn.ReLU(), config=config())
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ValueError, match="bad.json"):
        gigatron.initialize(model=model(), config=str(bad))
    with pytest.raises(ValueError, match="divisible|train_batch_size"):
        gigatron.initialize(model=model(), config=config(train_batch_size=7))
    engine, _, _, _ = gigatron.initialize(model=model(), config=config())
    with pytest.raises(RuntimeError, match="before engine.backward"):
        engine.step()
    with pytest.raises(ValueError, match="a scalar loss"):
        engine.backward(engine(torch.randn(2, 8)))


def test_inputs_on_the_wrong_dtype_fail_or_are_cast_when_asked():
    import gigatron

    engine, _, _, _ = gigatron.initialize(model=model(), config=config(bf16={"enabled": True}))
    with pytest.raises(ValueError, match=r"x.to\(engine.device, dtype=engine.dtype\)"):
        engine(torch.randn(2, 8))
    engine, _, _, _ = gigatron.initialize(model=model(), config=config(
        bf16={"enabled": True}, auto_cast_inputs=True))
    assert engine(torch.randn(2, 8)).dtype == torch.bfloat16


def test_zero3_refuses_a_module_whose_parameters_changed():
    import gigatron

    net = model()
    engine, _, _, _ = gigatron.initialize(model=net, config=config(
        zero_optimization={"stage": 3}))
    net[2] = nn.Linear(16, 4)
    with pytest.raises(RuntimeError, match="ZeRO stage 3 partitioned"):
        engine(torch.randn(2, 8))


def _save_on_rank_0_only(rank, world, folder):
    from datetime import timedelta

    import gigatron

    gigatron.init_distributed(timeout=timedelta(seconds=3))  # DeepSpeed's call, before initialize
    engine, _, _, _ = gigatron.initialize(model=model(), config=config(
        train_batch_size=2 * world))
    start = time.monotonic()
    try:
        if rank == 0:
            engine.save_checkpoint(folder)
        else:
            time.sleep(4)  # past rank 0's 3 s wait
            return "did not call"
    except RuntimeError as err:
        return str(err), time.monotonic() - start
    return "saved"


def test_save_checkpoint_on_only_some_ranks_fails_within_the_timeout(tmp_path):
    results = run_on_ranks(_save_on_rank_0_only, 2, str(tmp_path), timeout=60)
    message, waited = results[0]
    assert "save_checkpoint is collective: every rank must call it, but rank 1 did not" \
        in message and waited < 5, results
    assert not os.path.exists(tmp_path / "latest")


def _resume_on_ranks(rank, world, folder, stage):
    import gigatron

    def fresh():
        return gigatron.initialize(model=model(), training_data=Pairs(), config=config(
            zero_optimization={"stage": stage}, bf16={"enabled": True},
            scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 10,
                                                           "warmup_num_steps": 2}}))

    def run(engine, loader, upto, skip=0):
        it, out = iter(loader), []
        for _ in range(skip):
            next(it)
        while engine.global_steps < upto:
            x, y = next(it)
            loss = F.cross_entropy(engine(x.bfloat16()).float(), y)
            engine.backward(loss)
            engine.step()
            out.append(loss.item())
        return out

    engine, _, loader, _ = fresh()
    straight = run(engine, loader, 4)
    engine, _, loader, _ = fresh()
    first = run(engine, loader, 2)
    engine.save_checkpoint(folder, tag="mid")
    engine, _, loader, _ = fresh()
    engine.load_checkpoint(folder)
    rest = run(engine, loader, 4, skip=len(first))
    return first + rest == straight, engine.global_steps


@pytest.mark.parametrize("stage", [2, 3])
def test_save_load_continue_is_bit_exact_on_two_ranks(tmp_path, stage):
    results = run_on_ranks(_resume_on_ranks, 2, str(tmp_path), stage, timeout=90)
    assert results == [(True, 4), (True, 4)]
