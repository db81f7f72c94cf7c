"""Checkpoint files: one folder per iteration, every rank's shard, an atomically updated tracker.

    SAVE/latest_checkpointed_iteration.txt    "10"  (Megatron's tracker name and content)
    SAVE/iter_0000010/metadata.json           iteration, layout (tp, pp, dp, zero stage), flags
    SAVE/iter_0000010/mp_rank_TT_PPP_DDD/model_optim_rng.pt   one per rank (tp, pp, dp)

Saving is crash-safe: ranks write into `iter_XXXXXXX.tmp/` (each file under a temporary
name, then renamed), a barrier waits for ALL ranks, rank 0 renames the folder to its final
name, and only then replaces the tracker (write a temporary file + os.replace). A crash at
any point leaves the tracker naming the previous, complete checkpoint.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any, Callable, Dict, Optional, Tuple

import torch

TRACKER = "latest_checkpointed_iteration.txt"
METADATA = "metadata.json"
FORMAT_VERSION = 1


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_file(folder: str, coords: Dict[str, int], fmt: str = "torch") -> str:
    """This rank's shard inside an iteration folder."""
    name = f"mp_rank_{coords['tp']:02d}_{coords['pp']:03d}_{coords['dp']:03d}"
    ext = "safetensors" if fmt == "safetensors" else "pt"
    return os.path.join(folder, name, f"model_optim_rng.{ext}")


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to `path` so readers see the old or the new content, never a mix."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_tracker(root: str) -> Optional[int]:
    """The last complete checkpoint's iteration, or None when `root` has none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if text == "release":
        return 0
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"checkpoint tracker {path} holds {text!r}, not an iteration number: "
                         f"fix or delete it") from None


def write_shard(path: str, state: Dict[str, Any], fmt: str = "torch") -> None:
    """Write one rank's state under a temporary name, then rename it into place."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.part"
    if fmt == "safetensors":
        from gigatron.training.safetensors_io import save_state
        save_state(state, tmp)
    else:
        torch.save(state, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_shard(path: str, fmt: str = "torch") -> Dict[str, Any]:
    if not os.path.isfile(path):
        raise ValueError(f"checkpoint shard {path} is missing: the checkpoint is incomplete or "
                         f"was saved with a different layout")
    if fmt == "safetensors":
        from gigatron.training.safetensors_io import load_state
        return load_state(path)
    return torch.load(path, map_location="cpu", weights_only=False)


def save_checkpoint(root: str, iteration: int, state: Dict[str, Any], coords: Dict[str, int],
                    metadata: Dict[str, Any], barrier: Callable[[], None], is_first: bool,
                    fmt: str = "torch") -> str:
    """Collective: every rank passes its state; returns the final iteration folder.

    `barrier` synchronises all ranks of the job; `is_first` is true on exactly one rank,
    which prepares the folder, publishes it and updates the tracker.
    """
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    if is_first:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save of this iteration
        os.makedirs(tmp)
    barrier()
    write_shard(rank_file(tmp, coords, fmt), state, fmt)
    barrier()  # every rank's shard is complete before anything is published
    if is_first:
        _publish(root, iteration, tmp, final, metadata)
    barrier()
    return final


def _publish(root: str, iteration: int, tmp: str, final: str, metadata: Dict[str, Any]) -> None:
    with open(os.path.join(tmp, METADATA), "w", encoding="utf-8") as f:
        json.dump({"format_version": FORMAT_VERSION, "iteration": iteration, **metadata}, f,
                  indent=1, default=str)
    _fsync_dir(tmp)
    old = None
    if os.path.exists(final):  # re-saving an iteration: move the old copy aside first
        old = f"{final}.old.{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write_text(os.path.join(root, TRACKER), f"{iteration}\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_metadata(folder: str) -> Dict[str, Any]:
    path = os.path.join(folder, METADATA)
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: {folder} is not a complete gigatron checkpoint")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def check_layout(metadata: Dict[str, Any], layout: Dict[str, int], folder: str) -> None:
    """Loading across tp/pp/dp (or ZeRO stage) is not supported yet: say so clearly."""
    saved = {k: metadata.get(k) for k in layout}
    if saved != layout:
        got = " ".join(f"{k}={v}" for k, v in saved.items())
        want = " ".join(f"{k}={v}" for k, v in layout.items())
        raise ValueError(
            f"checkpoint {folder} was saved with {got} but this run has {want}: loading "
            f"across layouts is not supported yet; relaunch with the saved sizes")


def find_checkpoint(root: str) -> Tuple[Optional[int], Optional[str]]:
    """(iteration, folder) of the tracked checkpoint in `root`, or (None, None)."""
    iteration = read_tracker(root)
    if iteration is None:
        return None, None
    folder = iteration_dir(root, iteration)
    if not os.path.isdir(folder):
        # a crash while re-saving this iteration, between moving the old copy aside and
        # publishing the new one: the old copy is complete
        aside = sorted(glob.glob(f"{folder}.old.*"))
        if aside:
            os.replace(aside[-1], folder)
            return iteration, folder
        raise ValueError(f"{os.path.join(root, TRACKER)} names iteration {iteration} but "
                         f"{folder} does not exist")
    return iteration, folder
