"""The engine's load_checkpoint of a checkpoint that the real DeepSpeed wrote (ZeRO 0-3, fp32,
bf16 or fp16, with or without optimizer states) or that `ds_to_universal` converted: the
run goes on as DeepSpeed's own would, on any world size and ZeRO stage.

Every rank reads the tag whole (training/checkpoint/deepspeed/reader.py merges the ZeRO
shards of any saving world size), then keeps its own part: the fp32 masters and the
per-element optimizer states (exp_avg, exp_avg_sq) go into its ZeRO shards, buffers and
frozen parameters into the module; the step count, the param groups' options, the lr
scheduler, global_steps / global_samples / skipped_steps carry over. DeepSpeed saves no RNG
states and no micro-step count (micro_steps restarts at the step's boundary). The options
mean what they mean in DeepSpeed (engine/deepspeed/checkpoint.py), and client_state is what
DeepSpeed's load returns: every key of the model states file but its own.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import torch

from gigatron.training.checkpoint.deepspeed import reader
from gigatron.training.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
from gigatron.training.checkpoint.integrity import raise_if_any_failed
from gigatron.training.checkpoint.torch_dist import module_state
from gigatron.training.checkpoint.torch_dist import state as dist_state
from gigatron.training.checkpoint.torch_dist.planner import ShardedValue

if TYPE_CHECKING:
    from gigatron.engine.deepspeed.engine import Engine


def load(engine: "Engine", folder: str, gather: Any, strict: bool, load_optimizer: bool,
         load_scheduler: bool, module_only: bool) -> Dict[str, Any]:
    """Restore the engine from DeepSpeed's tag `folder` (collective); returns client_state.
    Any rank's failure stops every rank, before anything is installed."""
    failure: Optional[ValueError] = None
    ckpt: Optional[DeepSpeedCheckpoint] = None
    install: Callable[[], None] = lambda: None
    try:
        ckpt = reader.read(folder, with_optimizer=load_optimizer)
        if strict:
            _check_names(engine, ckpt)
        install = _read_into_engine(engine, ckpt, load_optimizer, strict)
    except ValueError as err:
        failure = err
    raise_if_any_failed(gather, failure, lambda ranks: (
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} could not load "
        f"DeepSpeed checkpoint {folder} (the error line of rank {ranks[0]} names the fix): "
        f"this rank stops too"))
    assert ckpt is not None
    install()
    if not module_only:
        _restore_progress(engine, ckpt, load_scheduler)
    return ckpt.client_state(load_optimizer, load_scheduler and not module_only)


def _read_into_engine(engine: "Engine", ckpt: DeepSpeedCheckpoint, load_optimizer: bool,
                      strict: bool) -> Callable[[], None]:
    """Copy this rank's parts into the engine's tensors, the ZeRO master shards and
    optimizer states themselves (not `strict`: what the checkpoint lacks keeps this
    engine's values); returns the collective step that installs them (ZeRO publishes the
    parameters over dp)."""
    zero, chunks = engine.zero, engine.zero.chunks
    module = {**ckpt.module, **ckpt.weights}  # frozen parameters and buffers, by name
    with torch.no_grad():
        _fill(module_state.module_tensors_to_load(zero, chunks, 0, 1), module, ckpt.folder,
              strict)
        if not load_optimizer:
            _fill(module_state.zero_weights_to_load(zero, chunks, 0, 1), ckpt.weights,
                  ckpt.folder, strict)
            return lambda: module_state.publish_weights(zero)
        keys = sorted(ckpt.states)
        values, resumed = dist_state.zero_state_to_load(zero, chunks, 0, 1, keys,
                                                        dist_state.MASTER)
        tensors = {dist_state.MASTER + n: t for n, t in ckpt.weights.items()}
        for key in keys:
            tensors.update({dist_state.optimizer_key(key) + n: t
                            for n, t in ckpt.states[key].items()})
        _fill(values, tensors, ckpt.folder, strict)
    options = _param_group_options(engine, ckpt)
    scalars = {k: torch.tensor(float(v)) if k == "step" else v for k, v in ckpt.scalars.items()}

    scaler = zero.scaler.state_dict()  # the saved loss scale, for the fields both have
    scaler.update({k: v for k, v in ckpt.loss_scale.items() if k in scaler})

    def install() -> None:
        zero.load_resharded(resumed.masters, resumed.per_element, scalars, scaler,
                            int(ckpt.model_states.get("skipped_steps", 0)))
        for group, saved in zip(zero.optimizer.param_groups, options):
            for key, value in saved.items():
                if isinstance(group.get(key), torch.Tensor):
                    group[key].fill_(value)
                else:
                    group[key] = value
    return install


def _fill(values: Dict[str, ShardedValue], tensors: Dict[str, torch.Tensor], folder: str,
          strict: bool) -> None:
    """Copy each piece of `values` out of the whole tensor of its key (or name)."""
    for key, value in values.items():
        name = key.split(".", 2)[-1] if key.startswith("optimizer.") else \
            key[len(dist_state.MODEL):]
        tensor = tensors.get(key, tensors.get(name))
        if tensor is None and not strict:
            continue
        if tensor is None:
            raise ValueError(f"DeepSpeed checkpoint {folder} holds no {key!r}: it was saved "
                             f"from another model or optimizer; pass load_module_strict=False "
                             f"to keep this engine's values for what it lacks")
        if tuple(tensor.shape) != tuple(value.global_shape):
            raise ValueError(f"DeepSpeed checkpoint {folder}: {name!r} has shape "
                             f"{tuple(tensor.shape)}, this engine's has "
                             f"{tuple(value.global_shape)}: build the model it was saved from")
        for offsets, piece in value.pieces:
            index = tuple(slice(o, o + s) for o, s in zip(offsets, piece.shape))
            piece.copy_(tensor[index])


def _check_names(engine: "Engine", ckpt: DeepSpeedCheckpoint) -> None:
    """load_module_strict: the checkpoint and the module have the same names."""
    mine = {n[len(dist_state.MODEL):] for n in module_state.checkpoint_names(engine.zero.chunks)}
    saved = set(ckpt.weights) | set(ckpt.buffers) | {
        n for n, t in ckpt.module.items() if t.numel()}
    missing, unexpected = sorted(mine - saved), sorted(saved - mine)
    if missing or unexpected:
        parts = ([f"lacks {missing[:3]} of this module"] if missing else []) + (
            [f"holds {unexpected[:3]} that this module has not"] if unexpected else [])
        raise ValueError(f"DeepSpeed checkpoint {ckpt.folder} {' and '.join(parts)}: it was "
                         f"saved from another model; pass load_module_strict=False to load "
                         f"the names both have")


def _param_group_options(engine: "Engine", ckpt: DeepSpeedCheckpoint) -> List[Dict[str, Any]]:
    """The saved groups' options this engine's optimizer has (lr, betas, eps, ...)."""
    groups = engine.zero.optimizer.param_groups
    if not ckpt.param_groups:
        return []
    if len(ckpt.param_groups) != len(groups):
        raise ValueError(f"{ckpt.folder} was saved with {len(ckpt.param_groups)} optimizer "
                         f"param groups, this engine has {len(groups)}: give initialize the "
                         f"same model_parameters groups, or pass load_optimizer_states=False")
    return [{k: v for k, v in saved.items() if k in group and k != "params"}
            for saved, group in zip(ckpt.param_groups, groups)]


def _restore_progress(engine: "Engine", ckpt: DeepSpeedCheckpoint, load_scheduler: bool
                      ) -> None:
    """Counters and the lr scheduler, as DeepSpeed's load restores them."""
    states = ckpt.model_states
    engine.global_steps = int(states.get("global_steps", 0))
    engine.global_samples = int(states.get("global_samples",
                                           engine.global_steps * engine.train_batch_size()))
    engine.skipped_steps = int(states.get("skipped_steps", 0))
    engine.micro_steps = engine.global_steps * engine.gradient_accumulation_steps()
    scheduler = engine.lr_scheduler
    if load_scheduler and scheduler is not None and states.get("lr_scheduler") is not None:
        scheduler.load_state_dict(states["lr_scheduler"])
