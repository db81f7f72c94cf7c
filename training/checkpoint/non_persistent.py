"""Non-persistent checkpoints (Megatron's --non-persistent-save-interval): frequent, cheap
checkpoints of which only the newest is kept, so that a failure costs at most that many
iterations. --load resumes from the non-persistent checkpoint when it is newer than the
persistent one (the tracker in --load), else from the persistent one; --ckpt-step always
loads the persistent iteration it names.

Kinds (--non-persistent-ckpt-type):
- global: a checkpoint as --save writes it (its --ckpt-format, atomic the same way, its own
  tracker) in --non-persistent-global-ckpt-dir, default --save/non_persistent (at load:
  --load/non_persistent); once the new one is published, older ones are deleted.
- local, in_memory: each rank keeps its own state (training/checkpoint/rank_copies.py).

A persistent save that finishes makes non-persistent checkpoints of its iteration or older
useless: they are deleted then (so the normal end of training, which saves, leaves none in host memory).
"""
from __future__ import annotations

import glob
import os
import shutil
from typing import Any, Callable, Dict, Optional, Tuple, Union

from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint import rank_copies
from gigatron.training.config.run_config import CheckpointConfig, RunConfig

SUBDIR = "non_persistent"  # Megatron's default folder of global ones, inside --save
SHM = "/dev/shm"


def global_dir(ck: CheckpointConfig, root: str) -> str:
    """The folder of global non-persistent checkpoints of the --save/--load folder `root`."""
    return ck.non_persistent_global_ckpt_dir or os.path.join(root, SUBDIR)


def copies_dir(ck: CheckpointConfig, root: str) -> str:
    """The folder of this job's local / in_memory checkpoints (`root`: --save or --load)."""
    kind = ck.non_persistent_ckpt_type
    assert kind in rank_copies.KINDS
    base = ck.non_persistent_local_ckpt_dir or SHM
    return rank_copies.job_folder(base, kind, root)


def destination(run: RunConfig, rank: int, iteration: int, persistent: bool
                ) -> Tuple[str, Callable[[], None]]:
    """Where a persistent or global non-persistent save of `iteration` goes, and what to
    delete once it is published."""
    ck = run.checkpoint
    assert ck.save is not None  # checked before saving
    if persistent:
        return ck.save, lambda: drop_older(ck, ck.save or "", rank, iteration)
    root = global_dir(ck, ck.save)
    return root, lambda: _keep_global(root, rank, iteration)


def _keep_global(root: str, rank: int, iteration: int) -> None:
    """Rank 0 deletes every global non-persistent folder but the newest (crashed saves'
    leftovers included)."""
    if rank != 0:
        return
    keep = files.iteration_dir(root, iteration)
    for folder in glob.glob(os.path.join(root, "iter_*")):
        if folder != keep:
            shutil.rmtree(folder, ignore_errors=True)


def drop_older(ck: CheckpointConfig, root: str, rank: int, iteration: int) -> None:
    """After the persistent checkpoint of `iteration` is published: delete this rank's
    share of the non-persistent checkpoints not newer than it (never loaded any more)."""
    kind = ck.non_persistent_ckpt_type
    if kind in rank_copies.KINDS:
        rank_copies.remove_copies(copies_dir(ck, root), rank, up_to=iteration)
    elif kind == "global" and rank == 0:
        folder = global_dir(ck, root)
        tracked = _tracked(folder)
        if tracked is not None and tracked <= iteration:
            os.remove(os.path.join(folder, files.TRACKER))  # first: it never names a gap
            shutil.rmtree(files.iteration_dir(folder, tracked), ignore_errors=True)


def _tracked(root: str) -> Optional[int]:
    try:
        return files.read_tracker(root)
    except (OSError, ValueError):
        return None


def newer_checkpoint(run: RunConfig, rank: int, layout: Dict[str, Any]
                     ) -> Union[None, str, Dict[str, Any]]:
    """Collective: what --load resumes from instead of the persistent checkpoint: None
    (the persistent one), a global non-persistent folder, or this rank's local / in_memory
    state (a shard as training/checkpoint/orchestrator.py loads it). A non-persistent
    checkpoint that cannot be used is named in one line (rank 0 prints it)."""
    ck = run.checkpoint
    kind = ck.non_persistent_ckpt_type
    if kind is None or ck.load is None or ck.ckpt_step is not None:
        return None
    persistent = _tracked(ck.load)
    newer_than = -1 if persistent is None else persistent
    if kind == "global":
        root = global_dir(ck, ck.load)
        iteration = _tracked(root)
        if iteration is None or iteration <= newer_than:
            return None
        return files.iteration_dir(root, iteration)
    state, note = rank_copies.load(copies_dir(ck, ck.load), kind, rank,
                                   run.parallel.world_size, layout, newer_than,
                                   run.parallel.distributed_timeout_minutes)
    if note is not None and rank == 0:
        print(note, flush=True)
    return state
