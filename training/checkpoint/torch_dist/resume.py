"""--load of a torch_dist checkpoint into any layout: the two phases of training/checkpoint/orchestrator.py.

Phase 1 (`load_weights`, before ZeRO exists) checks every file's checksum (each rank its
share), compares the checkpoint's global tensors with the single-device model of this run's
flags, and reads into each chunk parameter the parts of its global tensor this rank holds
(its tp slice: several boxes for stacked blocks, the vocabulary padding left alone). It also
reads the small common state (progress, lr schedule, optimizer scalars) and, when the
(tp, pp) layout is the saved one, this position's RNG states: as in Megatron, RNG states do
not carry over to another (TP, PP) layout (a line says so).

Phase 2 (`load_optimizer`, after ZeRO is built) reads the fp32 masters (or, for an fp32
model, the weights) and the per-element optimizer states straight into this rank's ZeRO
shards, whatever ZeRO stage, dp size and bucket layout saved them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from gigatron.training.checkpoint.torch_dist import save_load
from gigatron.training.checkpoint.torch_dist import state as dist_state
from gigatron.training.checkpoint.shapes import check_global_shapes
from gigatron.training.config.run_config import RunConfig

if TYPE_CHECKING:
    from gigatron.parallel.topology import ProcessGroups
    from gigatron.parallel.zero.optimizer import ZeroOptimizer


def load_weights(run: RunConfig, groups: "ProcessGroups", chunks: List[torch.nn.Module],
                 folder: str, meta: Dict[str, Any]) -> Dict[str, Any]:
    """Phase 1 on this rank: the weights into `chunks`; returns the checkpoint's common
    state and this position's RNG states (when they apply) as the 'shard' of training/checkpoint/orchestrator.py."""
    coords = groups.coords
    save_load.verify_files(folder, meta, groups.rank, run.parallel.world_size)
    entries = save_load.entries(folder)
    saved = {k[len(dist_state.MODEL):]: tuple(md.size) for k, md in entries.items()
             if k.startswith(dist_state.MODEL) and hasattr(md, "size")}
    check_global_shapes(saved, single_device_shapes(run), meta.get("flags"), run.flags,
                        folder)
    state: Dict[str, Any] = dict(dist_state.model_weights_to_load(chunks, coords["tp"],
                                                                  run.parallel.tp))
    state[dist_state.COMMON] = None
    saved_layout = (meta.get("tp"), meta.get("pp"))
    rng_key = dist_state.rng_key(coords["tp"], coords["pp"])
    note = None
    if saved_layout != (run.parallel.tp, run.parallel.pp):
        note = (f"(TP, PP) mismatch after resume ({(run.parallel.tp, run.parallel.pp)} vs "
                f"{saved_layout} from checkpoint): RNG state will be ignored")
    elif rng_key in entries:
        state[rng_key] = None
    elif meta.get("converted_from"):  # Megatron's RNG streams are not gigatron's
        note = (f"{folder} was converted from {meta['converted_from']} and holds no RNG "
                f"state: the run seeds its generators from --seed")
    with torch.no_grad():
        save_load.read(folder, state)
    shard = dict(state[dist_state.COMMON] or {})
    shard.update({"rng": state.get(rng_key), "_rng_note": note})
    return shard


def single_device_shapes(run: RunConfig) -> Dict[str, tuple]:
    """Global name -> global shape of every parameter and persistent buffer of this run's
    single-device model (built on the meta device: nothing is allocated)."""
    from gigatron.models.gpt import GPTModel

    assert run.model is not None  # a training run's model config
    model = GPTModel(run.model, device=torch.device("meta"))
    names = dist_state.global_names([model])
    shapes = {names[id(p)][0]: dist_state.placement_of(p, 0, 1).global_shape
              for p in model.parameters()}
    shapes.update({name: tuple(t.shape) for name, t in dist_state.persistent_buffers([model])})
    return shapes


def read_optimizer(run: RunConfig, shard: Dict[str, Any], chunks: List[torch.nn.Module],
                   zero: "ZeroOptimizer") -> Callable[[], None]:
    """Phase 2 on this rank: read the masters and optimizer states laid out like ZeRO's
    shards; returns the step that installs them (collective: ZeRO publishes the updated
    parameters over dp, so every rank calls it once all have read)."""
    folder = shard["_folder"]
    saved = shard.get("optimizer")
    if saved is None:
        raise ValueError(f"{folder} holds no optimizer state (saved with --no-save-optim, or "
                         f"weights only): add --no-load-optim")
    return read_zero_state(folder, saved, chunks, zero, run.parallel.tp)


def read_zero_state(folder: str, saved: Dict[str, Any], chunks: List[torch.nn.Module],
                    zero: "ZeroOptimizer", tp_size: int, only_saved: bool = False
                    ) -> Callable[[], None]:
    """Read a checkpoint's masters and optimizer states (`saved`: common's "optimizer")
    into tensors laid out like this rank's ZeRO shards, whatever layout saved them, for any
    model ZeRO trains; returns the collective step that installs them. `only_saved`: skip
    tensors the checkpoint lacks (they keep this run's values) instead of failing."""
    entries = save_load.entries(folder)
    has_masters = any(k.startswith(dist_state.MASTER) for k in entries)
    values, resumed = dist_state.zero_state_to_load(
        zero, chunks, zero.process_groups.tp_rank, tp_size, list(saved["per_element"]),
        dist_state.MASTER if has_masters else dist_state.MODEL)
    with torch.no_grad():
        save_load.read(folder, {k: v for k, v in values.items()
                                if not only_saved or k in entries})
    same_scaler = saved.get("scaler_type") == type(zero.scaler).__name__
    return lambda: zero.load_resharded(
        resumed.masters, resumed.per_element, saved["scalars"],
        saved["scaler"] if same_scaler else zero.scaler.state_dict(),
        saved.get("skipped_steps", 0))


def rng_note(shard: Optional[Dict[str, Any]]) -> Optional[str]:
    """The line saying that the saved RNG states were not restored, if they were not."""
    return None if shard is None else shard.get("_rng_note")
