"""Saving and resuming an offloaded ZeRO run (--optimizer-cpu-offload) keeps the host within
the step's budget: no second full-size copy of the masters or the optimizer state.

WideLM (below), bf16, ZeRO 2, AdamW, dp2 (forked gloo ranks), 3 steps, then every way out
and back in: a per-rank save (torch and safetensors), a local non-persistent copy, a
torch_dist save, synchronous and in the background (--async-save's staging, the next step
waiting for the write); resumes from each into a fresh run (and one that has stepped), 2
more steps, bit for bit equal to 5 steps in one go. The host bytes are the live bytes of
every new CPU storage an aten op makes (`HostBytes`, a TorchDispatchMode that frees a
storage's bytes when it dies), at their peak while a save or a resume runs; a file read is
judged by the anonymous memory (RssAnon) it holds; P is the rank's shard of parameters.
Each test's docstring says what the code did before.
"""
import os
import threading
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from multirank import run_on_ranks
from zero_models import HIDDEN, VOCAB, Block, TinyLM, batches

from gigatron.parallel.zero import ZeroConfig, build_zero
from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint import rank_copies
from gigatron.training.checkpoint.safetensors_io import save_state
from gigatron.training.checkpoint.torch_dist import resume, save_load
from gigatron.training.checkpoint.torch_dist import state as dist_state
from gigatron.training.checkpoint.torch_dist.async_save import AsyncSaver

BATCH, WIDTH = 12, 256
CONFIG = dict(zero_stage=2, lr=1e-2, weight_decay=0.1, reduce_bucket_size=60_000,
              clip_grad=0.05, offload_optimizer="cpu", offload_bucket_size=20_000)


class WideLM(TinyLM):
    """TinyLM with two 256-wide blocks between 16-wide ends (~0.5M parameters): the pieces
    a checkpoint writes are few and large, so DCP's plans weigh little beside them."""

    def __init__(self, seed: int) -> None:
        super().__init__(layers=0, seed=seed)
        self.widen, self.narrow = nn.Linear(HIDDEN, WIDTH), nn.Linear(WIDTH, HIDDEN)
        self.wide = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.to(torch.bfloat16)

    def forward(self, tokens, labels):
        x = self.widen(self.embedding(tokens))
        for layer in self.wide:
            x = layer(x)
        logits = self.output(self.final_norm(self.narrow(x))).float()
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                           reduction="none").view_as(labels)


class HostBytes(TorchDispatchMode):
    """Peak live bytes of the CPU storages aten ops create inside (views, in-place ops and
    outputs sharing an input's storage create none)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in inputs or storage.nbytes() == 0:
                continue
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, storage.nbytes())
        return out

    def _free(self, n: int) -> None:
        self.live -= n


def _train(rank, world, model, zero, first, steps):
    per, losses = BATCH // world, []
    for tokens, labels in batches(first + steps, BATCH)[first:]:
        zero.zero_grad()
        loss = model(tokens[rank * per:(rank + 1) * per],
                     labels[rank * per:(rank + 1) * per]).float().mean()
        zero.backward(loss)
        zero.step()
        losses.append(loss.item())
    with zero.gathered_parameters():
        return losses, {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _build(seed=0):
    model = WideLM(seed)
    return model, build_zero(model, ZeroConfig(**CONFIG))


def _values(zero, model, rank):
    values, scalars = dist_state.zero_state_to_save(zero, [model], 0, 1, rank, True)
    state = dict(values)
    state[dist_state.COMMON] = {"optimizer": dist_state.optimizer_common(zero, scalars)}
    return state


def _save_dist(state, root, rank, group=None):
    return save_load.save(root, 3, state, {"tp": 0, "pp": 0, "dp": rank},
                          {"iteration": 3, "tp": 1, "pp": 1}, group)


def _measured(action):
    with HostBytes() as host:
        result = action()
    return host.peak, result


def _save_in_background(rank, world, model, zero, root, peaks):
    """--async-save's way (orchestrator.py): the weights staged, the host masters and
    states written in place while the next forward and backward run; the write is held
    back a while, and the next step waits for it. Returns the continued run, the folder."""
    live = dist_state.host_optimizer_storages(zero)
    values = _values(zero, model, rank)
    peaks["async_staging"], state = _measured(lambda: dist_state.staged(values, live))
    saver, gate = AsyncSaver(), threading.Event()
    group = saver.group(1.0)

    def write():
        gate.wait()
        return _save_dist(state, root, rank, group)
    saver.start(3, 0.0, write)
    zero.hold_step(saver.join)
    threading.Timer(0.3, gate.set).start()
    continued = _train(rank, world, model, zero, 3, 2)
    return continued, saver.wait().folder


def _everything(rank, world, root):
    """(shard params, peaks, uninterrupted run, continued and resumed runs) on this rank."""
    model, zero = _build()
    whole = _train(rank, world, model, zero, 0, 5)
    model, zero = _build()
    _train(rank, world, model, zero, 0, 3)
    shard = sum(g.shard_numel for g in zero.flat_groups)
    per_rank = os.path.join(root, f"rank{rank}.pt")
    peaks = {"per_rank_save": _measured(lambda: torch.save(zero.state_dict(), per_rank))[0]}
    peaks["safetensors_save"], _ = _measured(lambda: save_state(
        {"optimizer": zero.state_dict()}, os.path.join(root, f"rank{rank}.safetensors")))
    job, layout = os.path.join(root, "local"), {"dp": world}
    rank_copies.RankCopies("local", 1.0).save(job, {"optimizer": zero.state_dict()},
                                              {"iteration": 3, "layout": layout}, rank, world,
                                              torch.device("cpu"))
    peaks["torch_dist_save"], folder = _measured(
        lambda: _save_dist(_values(zero, model, rank), os.path.join(root, "sync"), rank))
    continued, background = _save_in_background(rank, world, model, zero,
                                                 os.path.join(root, "async"), peaks)
    runs = {"continued after the background save": continued}
    # a fresh run (as pretrain resumes: no optimizer state yet) and a run that has stepped
    for name, seed, stepped, where in (("fresh", 99, 0, folder), ("stepped", 7, 2, folder),
                                       ("from the background save", 5, 0, background)):
        model, zero = _build(seed)
        if stepped:
            _train(rank, world, model, zero, 0, stepped)
        saved = save_load.read_common(where)["optimizer"]
        peaks[name], _ = _measured(lambda: resume.read_zero_state(where, saved, [model],
                                                                  zero, 1)())
        runs[name] = _train(rank, world, model, zero, 3, 2)
    for name, seed, stepped in (("per-rank fresh", 11, 0), ("per-rank stepped", 13, 2),
                                ("local non-persistent", 17, 0)):
        model, zero = _build(seed)
        if stepped:
            _train(rank, world, model, zero, 0, stepped)
        loaded = None  # the last run's moments are freed before, not while, this one reads
        anon = _status_kib("RssAnon")
        loaded = files.read_shard(per_rank) if name.startswith("per-rank") else \
            rank_copies.load(job, "local", rank, world, layout, 0, 1.0)[0]["optimizer"]
        peaks[name + " read"] = (_status_kib("RssAnon") - anon) * 1024
        peaks[name + " mapped"] = _file_backed_fraction(loaded)
        peaks[name], _ = _measured(lambda: zero.load_state_dict(loaded))
        runs[name] = _train(rank, world, model, zero, 3, 2)
    return shard, peaks, (whole[0][3:], whole[1]), runs


def _file_backed_fraction(state):
    """The fraction of the bytes of the tensors in `state` that lie in file-backed mappings
    (/proc/self/maps lines with a path: the checkpoint file mapped by torch.load(mmap=True))
    rather than in anonymous memory."""
    spans = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/"):
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                spans.append((lo, hi))
    tensors, todo = [], [state]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
    total = sum(t.numel() * t.element_size() for t in tensors)
    mapped = sum(t.numel() * t.element_size() for t in tensors
                 if any(lo <= t.data_ptr() < hi for lo, hi in spans))
    return mapped / max(total, 1)


def _status_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload_ckpt"))
    return run_on_ranks(_everything, 2, root)


def test_saving_an_offloaded_run_makes_no_full_size_host_copy(runs):
    """Per-rank formats (ZeroOptimizer.state_dict through torch.save or the safetensors
    writer) and torch_dist: at most an eighth of a byte per parameter (DCP's plans; the
    per-rank save cloned the masters, 4 P; safetensors cloned every tensor, 12 P, and built
    the file in memory; DCP cloned every piece of the shards and held them until the file
    was written, 14 P)."""
    for shard, peaks, _, _ in runs:
        for kind in ("per_rank_save", "safetensors_save", "torch_dist_save"):
            assert peaks[kind] <= shard / 8, (kind, peaks[kind], shard)


def test_resuming_an_offloaded_run_reads_into_the_live_shards(runs):
    """Besides the bf16 all-gather sources of the published parameters (2 P, as every
    step), a fresh optimizer makes its two Adam moments once, where they stay (8 P: the
    step's own budget, which its first step would make otherwise); one that has stepped
    makes nothing (the fresh masters and states were 12 P more)."""
    for shard, peaks, _, _ in runs:
        assert peaks["fresh"] <= 10 * shard + shard / 8, (peaks, shard)
        assert peaks["stepped"] <= 2 * shard + shard / 8, (peaks, shard)


def test_a_per_rank_resume_maps_the_shard_instead_of_reading_it(runs):
    """--ckpt-format torch and a local non-persistent copy: the file is mapped, not read
    into anonymous memory (it was, beside the live masters: ~4 P measured, up to 14 P; a
    local copy was read as bytes and then unpickled, twice that); the optimizer adopts the
    mapped moments (written, and so made private, by the next step) as torch's load does; the
    load makes only the parameters' all-gather sources (2 P, as every step)."""
    for shard, peaks, _, _ in runs:
        for name in ("per-rank fresh", "per-rank stepped", "local non-persistent"):
            # where the loaded tensors lie, not the process's anonymous memory: its growth
            # (peaks[name + " read"]) moved by ~10 P with the allocator's state in a long-
            # lived test process, on a shard of 0.27 MB
            assert peaks[name + " mapped"] == 1.0, (name, peaks, shard)
            assert peaks[name] <= 2 * shard + shard / 8, (name, peaks, shard)


def test_a_background_save_copies_only_the_weights_and_the_next_step_waits_for_it(runs):
    """The bf16 weights are staged (2 P); the masters and moments are not (they were, 12 P
    more): the step after the save waits until they are written, so the checkpoint holds
    iteration 3's state (checked by the resume below) and training goes on unchanged."""
    for shard, peaks, _, _ in runs:
        assert peaks["async_staging"] <= 2 * shard + shard / 8, (peaks, shard)


def test_an_offloaded_run_resumed_from_torch_dist_continues_bit_for_bit(runs):
    for _, _, (losses, params), resumed in runs:
        assert len(resumed) == 7
        for name, (resumed_losses, resumed_params) in resumed.items():
            assert resumed_losses == losses, name
            for key, want in params.items():
                assert torch.equal(resumed_params[key], want), (name, key)
