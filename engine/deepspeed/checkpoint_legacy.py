"""Loading the engine's per-rank checkpoints, the format `save_checkpoint` wrote before it
wrote torch_dist folders (engine/deepspeed/checkpoint.py):

    SAVE_DIR/<tag>/iter_<global_steps>/mp_rank_00_000_<rank>/model_optim_rng.pt

one torch file per global rank holding the module, the rank's ZeRO shard, the scheduler,
the counters, the RNG states and client_state. They still load, into the world size that
wrote them (the ZeRO shards are tied to it; the module alone loads anywhere). To make one
layout-free, load it in its own layout and save it again.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict

from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint.rng import restore_generators

if TYPE_CHECKING:
    from gigatron.engine.deepspeed.engine import Engine

_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def load(engine: "Engine", folder: str, meta: Dict[str, Any], strict: bool,
         load_optimizer: bool, load_scheduler: bool, module_only: bool) -> Dict[str, Any]:
    """Restore this rank's shard of a per-rank checkpoint; returns its client_state."""
    saved_world = int(meta.get("world_size", 1))
    pipeline = engine.checkpoint_layout()[1]["pp"] > 1
    if saved_world != engine.world_size and (load_optimizer or pipeline):
        fix = "" if pipeline else ", or pass load_optimizer_states=False to load the module"
        raise ValueError(f"{folder} is a per-rank checkpoint saved by {saved_world} ranks, "
                         f"this run has {engine.world_size}: its "
                         f"{'pipeline stages' if pipeline else 'ZeRO shards'} need the same "
                         f"world size; load it with {saved_world} ranks and save it again "
                         f"(the torch_dist format, which loads anywhere){fix}")
    # the module is the same on every rank of a plain engine: any rank's file has it
    rank = engine.global_rank if saved_world == engine.world_size else 0
    coords = {"tp": 0, "pp": 0, "dp": rank}
    shard = files.read_shard(files.rank_file(folder, coords), metadata=meta)
    if load_optimizer:
        _load_with_optimizer(engine, shard["module"], shard["optimizer"], strict)
    else:
        _load_module_only(engine, shard["module"], strict)
    if module_only:
        return shard.get("client_state", {})
    if load_scheduler and engine.lr_scheduler is not None and shard.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(shard["lr_scheduler"])
    for name, value in shard["counters"].items():
        setattr(engine, name, value)
    if "rng" in shard:
        restore_generators(shard["rng"], engine.device)
    return shard.get("client_state", {})


def _load_with_optimizer(engine: "Engine", module_state: Dict[str, Any],
                         optimizer_state: Dict[str, Any], strict: bool) -> None:
    engine.zero.load_state_dict(optimizer_state)  # masters -> the module's parameters
    if engine.zero.stage < 3:
        engine.module.load_state_dict(module_state, strict=strict)  # buffers too
    else:  # stage-3 parameters live in the shards just loaded: only buffers remain
        buffers = {name for name, _ in engine.module.named_buffers()}
        engine.module.load_state_dict({k: v for k, v in module_state.items()
                                       if k in buffers}, strict=False)


def _load_module_only(engine: "Engine", module_state: Dict[str, Any], strict: bool) -> None:
    """Weights without the optimizer: into the module, then into ZeRO's fp32 masters."""
    if engine.zero.stage == 3:
        raise ValueError("load_checkpoint(load_optimizer_states=False) of a per-rank "
                         "checkpoint under ZeRO stage 3 is not supported: load it with the "
                         "optimizer states, or from a stage 0-2 engine (a torch_dist "
                         "checkpoint loads either way)")
    engine.module.load_state_dict(module_state, strict=strict)
    engine.zero.refresh_master_from_params()
