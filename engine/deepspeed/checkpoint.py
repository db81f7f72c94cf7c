"""The engine's save_checkpoint / load_checkpoint, on gigatron's checkpoint files.

    SAVE_DIR/latest                          the newest tag (DeepSpeed's file and content)
    SAVE_DIR/<tag>/iter_<global_steps>/...   one shard per rank, metadata.json with checksums

Under each tag the folder is written by `gigatron.training.checkpoint.folders.save_checkpoint`:
atomic (a crash leaves the previous checkpoint), a checksum per shard verified at load, and
a full disk on any rank failing the save on every rank with the path and the bytes needed.
`latest` is replaced (atomically) only after the tag is complete. Both calls are collective:
a rank that does not call them makes every caller fail within the collective timeout.
"""
from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

import numpy as np
import torch

from gigatron.engine.deepspeed.distributed import require_every_rank
from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint.integrity import job_gather, single_process_gather

if TYPE_CHECKING:
    from gigatron.engine.deepspeed.engine import Engine

LATEST = "latest"
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _coords(engine: "Engine") -> Dict[str, int]:
    return {"tp": 0, "pp": 0, "dp": engine.global_rank}


def _gather(engine: "Engine") -> Any:
    return job_gather(engine.device) if engine.world_size > 1 else single_process_gather


def save(engine: "Engine", save_dir: str, tag: Optional[str], client_state: Dict[str, Any],
         save_latest: bool) -> bool:
    """Write every rank's shard of this step under `save_dir/tag` (DeepSpeed's default tag
    global_step<N>), then point `latest` at it."""
    require_every_rank(engine.ctx, "save_checkpoint",
                       engine.next_checkpoint_call("save_checkpoint"))
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    state: Dict[str, Any] = {
        "module": engine.module_state_dict(), "optimizer": engine.zero.state_dict(),
        "lr_scheduler": _scheduler_state(engine.lr_scheduler),
        "counters": {name: getattr(engine, name) for name in _COUNTERS},
        "rng": _rng_state(engine.device), "client_state": client_state}
    meta = {"tag": tag, "world_size": engine.world_size, "zero_stage": engine.zero.stage,
            "ds_config": engine.config.resolved}
    root = os.path.join(save_dir, tag)
    gather = _gather(engine)
    files.save_checkpoint(root, engine.global_steps, state, _coords(engine), meta, gather,
                          engine.global_rank == 0)
    if save_latest and engine.global_rank == 0:
        files.atomic_write_text(os.path.join(save_dir, LATEST), tag)
    gather([0])  # no rank returns before `latest` names the new tag
    return True


def load(engine: "Engine", load_dir: str, tag: Optional[str], strict: bool,
         load_optimizer: bool, load_scheduler: bool
         ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Restore this rank's shard; (None, None) when `load_dir` holds no checkpoint."""
    require_every_rank(engine.ctx, "load_checkpoint",
                       engine.next_checkpoint_call("load_checkpoint"))
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            if engine.global_rank == 0:
                print(f"[gigatron] no checkpoint to load: {latest} does not exist", flush=True)
            return None, None
        tag = open(latest, encoding="utf-8").read().strip()
    root = os.path.join(load_dir, str(tag))
    _, folder = files.find_checkpoint(root)
    if folder is None:
        raise ValueError(f"load_checkpoint: no checkpoint with tag {tag!r} in {load_dir} "
                         f"({os.path.join(root, files.TRACKER)} is missing)")
    meta = files.read_metadata(folder)
    if meta.get("world_size") != engine.world_size and load_optimizer:
        raise ValueError(f"{folder} was saved by {meta.get('world_size')} ranks, this run has "
                         f"{engine.world_size}: the ZeRO shards need the same world size; "
                         f"pass load_optimizer_states=False to load only the module")
    shard = files.read_shard(files.rank_file(folder, _coords(engine)), metadata=meta)
    _restore(engine, shard, strict, load_optimizer, load_scheduler)
    return folder, shard.get("client_state", {})


def _restore(engine: "Engine", shard: Dict[str, Any], strict: bool, load_optimizer: bool,
             load_scheduler: bool) -> None:
    if load_optimizer:
        engine.zero.load_state_dict(shard["optimizer"])  # masters -> the module's parameters
        if engine.zero.stage < 3:
            engine.module.load_state_dict(shard["module"], strict=strict)  # buffers too
        else:  # stage-3 parameters live in the shards just loaded: only buffers remain
            buffers = {name for name, _ in engine.module.named_buffers()}
            engine.module.load_state_dict({k: v for k, v in shard["module"].items()
                                           if k in buffers}, strict=False)
    else:
        _load_module_only(engine, shard["module"], strict)
    if load_scheduler and engine.lr_scheduler is not None and shard.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(shard["lr_scheduler"])
    for name, value in shard["counters"].items():
        setattr(engine, name, value)
    if "rng" in shard:
        _restore_rng(shard["rng"], engine.device)


def _load_module_only(engine: "Engine", module_state: Dict[str, Any], strict: bool) -> None:
    """Weights without the optimizer: into the module, then into ZeRO's fp32 masters."""
    if engine.zero.stage == 3:
        raise ValueError("load_checkpoint(load_optimizer_states=False) under ZeRO stage 3 is "
                         "not supported: load with the optimizer states, or from a stage 0-2 "
                         "engine")
    engine.module.load_state_dict(module_state, strict=strict)
    engine.zero.refresh_master_from_params()


def _scheduler_state(scheduler: Any) -> Optional[Dict[str, Any]]:
    return scheduler.state_dict() if scheduler is not None and hasattr(
        scheduler, "state_dict") else None


def _rng_state(device: torch.device) -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _restore_rng(state: Dict[str, Any], device: torch.device) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
