"""The engine's save_checkpoint / load_checkpoint (DeepSpeed's API) on pretrain_gpt.py's
layout-free torch_dist checkpoint: saved on N ranks at any ZeRO stage (a PipelineModule at
any number of stages), it loads on M ranks at any stage and the run goes on.

    SAVE_DIR/latest                                     the newest tag (DeepSpeed's file)
    SAVE_DIR/<tag>/latest_checkpointed_iteration.txt    the tracker
    SAVE_DIR/<tag>/iter_<global_steps>/                 a torch_dist folder

What the folder holds (docs/CHECKPOINTS.md, "The engine's checkpoints"): `model.<name>`
under the module's own parameter and buffer names, the fp32 masters and per-element
optimizer states as global tensors (every rank writes the boxes of its ZeRO shards:
training/checkpoint/torch_dist/state.py and module_state.py), each rank's RNG states under
`rng.rank<R>`, and in `common` the counters, the lr scheduler, the optimizer's scalars,
param-group options and loss scaler, the pipeline's forward count and client_state.
The save is the orchestrator's (atomic, checksummed; a full disk on any rank fails it on
every rank); `latest` is replaced (atomically) only once the tag is complete.

DeepSpeed's load options: load_optimizer_states=False keeps this engine's optimizer state
and refreshes its fp32 masters from the loaded weights (the counters, scheduler and RNG
still load); load_lr_scheduler_states=False keeps this engine's scheduler;
load_module_only=True loads the weights and buffers only. Per-rank checkpoints written
before still load (checkpoint_legacy.py; the format is read from metadata.json), and so do
the real DeepSpeed's own tags and universal checkpoints (ds_format.py; told apart by their
mp_rank_00_model_states.pt; with "checkpoint": {"load_universal": true} the tag that
`latest_universal` names).

Both calls are collective: a rank that does not call them makes every caller fail within
the collective timeout.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch

from gigatron.engine.deepspeed import checkpoint_legacy, ds_format
from gigatron.engine.deepspeed.distributed import require_every_rank
from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint.deepspeed import reader as ds_reader
from gigatron.training.checkpoint.integrity import (job_gather, raise_if_any_failed,
                                                    single_process_gather)
from gigatron.training.checkpoint.rng import generator_states, restore_generators
from gigatron.training.checkpoint.torch_dist import module_state, save_load
from gigatron.training.checkpoint.torch_dist import state as dist_state
from gigatron.training.checkpoint.torch_dist.resume import read_zero_state

if TYPE_CHECKING:
    from gigatron.engine.deepspeed.engine import Engine

LATEST = "latest"
COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _gather(engine: "Engine") -> Any:
    return job_gather(engine.device) if engine.world_size > 1 else single_process_gather


def rng_key(rank: int) -> str:
    """A rank's RNG states: restored only into the layout that saved them."""
    return f"rng.rank{rank}"


def save(engine: "Engine", save_dir: str, tag: Optional[str], client_state: Dict[str, Any],
         save_latest: bool) -> bool:
    """Write this rank's part of this step under `save_dir/tag` (DeepSpeed's default tag
    global_step<N>), then point `latest` at it."""
    require_every_rank(engine.ctx, "save_checkpoint",
                       engine.next_checkpoint_call("save_checkpoint"))
    tag = str(tag) if tag is not None else f"global_step{engine.global_steps}"
    state, coords, meta = _state_to_save(engine, tag, client_state)
    save_load.save(os.path.join(save_dir, tag), engine.global_steps, state, coords, meta)
    if save_latest and engine.global_rank == 0:
        files.atomic_write_text(os.path.join(save_dir, LATEST), tag)
    _gather(engine)([0])  # no rank returns before `latest` names the new tag
    return True


def _state_to_save(engine: "Engine", tag: str, client_state: Dict[str, Any]
                   ) -> Tuple[Dict[str, Any], Dict[str, int], Dict[str, Any]]:
    """(this rank's torch_dist state, its coordinates, metadata.json's content)."""
    zero, chunks = engine.zero, engine.zero.chunks
    coords, sizes = engine.checkpoint_layout()
    values, scalars = dist_state.zero_state_to_save(zero, chunks, coords["tp"], sizes["tp"],
                                                    coords["dp"], with_optimizer=True)
    state: Dict[str, Any] = dict(values)
    state.update(module_state.buffers_to_save(chunks, coords["dp"] == 0 and coords["tp"] == 0))
    if engine.global_rank == 0:
        scheduler = engine.lr_scheduler
        state[dist_state.COMMON] = {
            "optimizer": {**dist_state.optimizer_common(zero, scalars), "param_groups": [
                {k: v for k, v in group.items() if k != "params"}
                for group in zero.optimizer.param_groups]},
            "counters": {name: getattr(engine, name) for name in COUNTERS},
            "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
            "lr_scheduler": scheduler.state_dict() if hasattr(scheduler, "state_dict")
            else None,
            "engine": engine.checkpoint_extra_state(), "client_state": client_state}
    state[rng_key(engine.global_rank)] = generator_states(engine.device)
    meta = {"tag": tag, "engine": type(engine).__name__, "world_size": engine.world_size,
            **sizes, "zero_stage": zero.stage, "ds_config": engine.config.resolved,
            "params_dtype": str(zero.param_dtype).replace("torch.", "")}
    return state, coords, meta


def load(engine: "Engine", load_dir: str, tag: Optional[str], strict: bool,
         load_optimizer: bool, load_scheduler: bool, module_only: bool
         ) -> Tuple[Optional[str], Optional[Dict[str, Any]]]:
    """Restore the engine from `load_dir/tag` (tag None: the one `latest` names); returns
    (the iteration folder, client_state), or (None, None) when `load_dir` holds none."""
    require_every_rank(engine.ctx, "load_checkpoint",
                       engine.next_checkpoint_call("load_checkpoint"))
    if tag is None:
        latest = os.path.join(load_dir, _latest_file(engine, load_dir))
        if not os.path.isfile(latest):
            if engine.global_rank == 0:
                print(f"[gigatron] no checkpoint to load: {latest} does not exist", flush=True)
            return None, None
        tag = open(latest, encoding="utf-8").read().strip()
    root = os.path.join(load_dir, str(tag))
    if ds_reader.is_deepspeed_folder(root):  # written by DeepSpeed itself (ds_format.py)
        return root, ds_format.load(engine, root, _gather(engine), strict, load_optimizer and
                                    not module_only, load_scheduler, module_only)
    _, folder = files.find_checkpoint(root)
    if folder is None:
        raise ValueError(f"load_checkpoint: no checkpoint with tag {tag!r} in {load_dir} "
                         f"({os.path.join(root, files.TRACKER)} is missing)")
    meta = files.read_metadata(folder)
    load_optimizer = load_optimizer and not module_only
    if save_load.checkpoint_format(meta) != save_load.FORMAT:
        return folder, checkpoint_legacy.load(engine, folder, meta, strict, load_optimizer,
                                              load_scheduler and not module_only, module_only)
    common = _read(engine, folder, meta, strict, load_optimizer, not module_only)
    if not module_only:
        _restore_progress(engine, common, load_scheduler)
    return folder, common.get("client_state", {})


def _latest_file(engine: "Engine", load_dir: str) -> str:
    """`latest`, or with DeepSpeed's checkpoint.load_universal the tag ds_to_universal wrote
    (`latest_universal`) where there is one."""
    universal = os.path.join(load_dir, ds_reader.LATEST_UNIVERSAL)
    if engine.config.checkpoint.get("load_universal") and os.path.isfile(universal):
        return ds_reader.LATEST_UNIVERSAL
    return LATEST


def _read(engine: "Engine", folder: str, meta: Dict[str, Any], strict: bool,
          load_optimizer: bool, load_rng: bool) -> Dict[str, Any]:
    """Read weights, buffers, optimizer state (if asked) and this rank's RNG states (if
    asked and the layout is the saved one) into the engine; returns `common`. Any rank's
    failure stops every rank, before anything is installed."""
    zero, chunks = engine.zero, engine.zero.chunks
    coords, sizes = engine.checkpoint_layout()
    every_name = _every_rank_names(chunks) if strict else set()
    failure: Optional[ValueError] = None
    common: Dict[str, Any] = {}
    own: Dict[str, Any] = {}
    install: Callable[[], None] = lambda: module_state.publish_weights(zero)
    try:
        save_load.verify_files(folder, meta, engine.global_rank, engine.world_size)
        entries = save_load.entries(folder)
        common = save_load.read_common(folder)
        _check_names(chunks, every_name, entries, folder)
        own = module_state.module_tensors_to_load(zero, chunks, coords["tp"], sizes["tp"])
        if load_optimizer:
            install = _optimizer_installer(engine, folder, common, strict)
        else:
            own.update(module_state.zero_weights_to_load(zero, chunks, coords["tp"],
                                                         sizes["tp"]))
        own = {k: v for k, v in own.items() if k in entries}  # strict: checked all are
        if load_rng and _same_layout(engine, meta) and rng_key(engine.global_rank) in entries:
            own[rng_key(engine.global_rank)] = None
        with torch.no_grad():
            save_load.read(folder, own)
    except ValueError as err:  # one rank's part may be damaged: all ranks stop together
        failure = err
    raise_if_any_failed(_gather(engine), failure, lambda ranks: (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} could not load "
        f"{'their parts' if len(ranks) > 1 else 'its part'} of checkpoint {folder} (the "
        f"error line of rank {ranks[0]} names the file and the fix): this rank stops too"))
    install()
    if own.get(rng_key(engine.global_rank)) is not None:
        restore_generators(own[rng_key(engine.global_rank)], engine.device)
    elif load_rng and engine.global_rank == 0:
        here = _layout_text({"world_size": engine.world_size, **sizes})
        print(f"[gigatron] load_checkpoint: RNG states not restored: {folder} was saved by "
              f"{_layout_text(meta)}, this run has {here} (a rank's generators are its own)",
              flush=True)
    return common


def _every_rank_names(chunks: Any) -> set:
    """The checkpoint names of every rank's module (collective: a pipeline stage knows its
    own layers only)."""
    mine = sorted(module_state.checkpoint_names(chunks))
    return {name for names in save_load.all_objects(mine, None) for name in names}


def _check_names(chunks: Any, every_name: set, entries: Dict[str, Any], folder: str) -> None:
    """load_module_strict: the checkpoint and the module have the same names (as torch's
    load_state_dict(strict=True))."""
    if not every_name:
        return
    saved = {k for k in entries if k.startswith(dist_state.MODEL)}
    missing = sorted(module_state.checkpoint_names(chunks) - saved)
    unexpected = sorted(saved - every_name)
    if missing or unexpected:
        cut = len(dist_state.MODEL)
        parts = ([f"lacks {_few([m[cut:] for m in missing])} of this module"] if missing else
                 []) + ([f"holds {_few([u[cut:] for u in unexpected])} that this module has "
                         f"not"] if unexpected else [])
        raise ValueError(f"checkpoint {folder} {' and '.join(parts)}: it was saved from "
                         f"another model (or other layer names); pass "
                         f"load_module_strict=False to load the names both have")


def _few(names: list) -> str:
    shown = ", ".join(repr(n) for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _optimizer_installer(engine: "Engine", folder: str, common: Dict[str, Any],
                         strict: bool) -> Callable[[], None]:
    """Read the optimizer state into this rank's ZeRO shards; returns the collective step
    that installs it, with the saved param-group options (lr, betas, ...: DeepSpeed restores
    the optimizer's state dict, groups included)."""
    saved = common.get("optimizer")
    if saved is None:
        raise ValueError(f"{folder} holds no optimizer state: pass "
                         f"load_optimizer_states=False")
    groups = engine.zero.optimizer.param_groups
    options = saved.get("param_groups", [])
    if len(options) != len(groups):
        raise ValueError(f"{folder} was saved with {len(options)} optimizer param groups, this "
                         f"engine has {len(groups)}: give initialize the same "
                         f"model_parameters groups, or pass load_optimizer_states=False")
    _, sizes = engine.checkpoint_layout()
    install_state = read_zero_state(folder, saved, engine.zero.chunks, engine.zero,
                                    sizes["tp"], only_saved=not strict)

    def install() -> None:
        install_state()  # torch's load_state_dict makes new group dicts: update those
        for group, saved_options in zip(engine.zero.optimizer.param_groups, options):
            for key, value in saved_options.items():
                if isinstance(group.get(key), torch.Tensor):
                    group[key].fill_(value)  # a tensor lr stays the same tensor (graphs)
                else:
                    group[key] = value
    return install


def _same_layout(engine: "Engine", meta: Dict[str, Any]) -> bool:
    _, sizes = engine.checkpoint_layout()
    return meta.get("world_size") == engine.world_size and all(
        meta.get(axis) == sizes[axis] for axis in ("tp", "pp"))


def _layout_text(layout: Dict[str, Any]) -> str:
    ranks = layout.get("world_size")
    return (f"{ranks} rank{'' if ranks == 1 else 's'} (tp {layout.get('tp')}, pp "
            f"{layout.get('pp')}, dp {layout.get('dp')})")


def _restore_progress(engine: "Engine", common: Dict[str, Any], load_scheduler: bool) -> None:
    """Counters, the lr scheduler (if asked) and the engine kind's own state. micro_steps
    follows this engine's gradient accumulation when the global batch is now split in
    other micro-batches (1 rank x 2 micro-batches after 2 ranks x 1)."""
    counters = common["counters"]
    for name in COUNTERS:
        setattr(engine, name, counters[name])
    accumulation = engine.gradient_accumulation_steps()
    if common.get("gradient_accumulation_steps") != accumulation:
        engine.micro_steps = engine.global_steps * accumulation
    if load_scheduler and engine.lr_scheduler is not None and common.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(common["lr_scheduler"])
    engine.load_checkpoint_extra_state(common.get("engine") or {})
