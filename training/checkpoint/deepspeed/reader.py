"""One DeepSpeed checkpoint tag, read whole: what a gigatron engine or converter needs.

    SAVE_DIR/latest                                          the newest tag
    SAVE_DIR/<tag>/mp_rank_00_model_states.pt                module, counters, lr_scheduler,
                                                             param_shapes, ds_config, client keys
    SAVE_DIR/<tag>/zero_pp_rank_<R>_mp_rank_00_model_states.pt    (ZeRO 3: one per rank)
    SAVE_DIR/<tag>/[bf16_]zero_pp_rank_<R>_mp_rank_00_optim_states.pt   ZeRO shards (1-3)
    SAVE_DIR/<tag>/layer_<L>-model_00-model_states.pt        a PipelineModule's layers

DeepSpeed's universal checkpoint (`ds_to_universal --output_folder SAVE_DIR/<tag>`) is a tag
folder with the model states file and `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`
(whole tensors under the module's names) and `zero/optimizer_state.pt` (param groups).

The ZeRO shards are merged here (zero_shards.py), so any world size loads what any world
size saved; only tensor- and pipeline-parallel saves (mp_rank_01, ...) are not read.
"""
from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from gigatron.training.checkpoint.deepspeed import zero_shards
from gigatron.training.checkpoint.deepspeed.zero_shards import Tensors

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"  # written by ds_to_universal next to `latest`
MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
UNIVERSAL = "zero"
_LAYER = re.compile(r"layer_(\d+)-model_00-model_states\.pt$")
# model states keys that are DeepSpeed's own; every other key is the user's client_state
# (DeepSpeed's load returns all keys but these, the optimizer and lr_scheduler when loaded)
ENGINE_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
               "data_sampler", "random_ltd", "lr_scheduler", "optimizer")


@dataclass
class DeepSpeedCheckpoint:
    """A tag's state: whole fp32 weights and optimizer states under the module's names."""

    folder: str
    universal: bool
    zero_stage: int
    world_size: int  # the data-parallel ranks that saved it
    model_states: Dict[str, Any]  # the model states file (rank 0's)
    module: Tensors  # the saved module state dict (buffers; weights in the saved dtype)
    weights: Tensors  # fp32: the masters where saved, else the module's weights
    states: Dict[str, Tensors] = field(default_factory=dict)  # exp_avg, exp_avg_sq, ...
    scalars: Dict[str, Any] = field(default_factory=dict)  # the step count
    param_groups: List[Dict[str, Any]] = field(default_factory=list)
    loss_scale: Dict[str, Any] = field(default_factory=dict)  # gigatron's scaler state names

    @property
    def buffers(self) -> Tensors:
        return {n: self.module[n] for n in self.model_states.get("buffer_names") or []
                if n in self.module}

    def client_state(self, load_optimizer: bool, load_scheduler: bool) -> Dict[str, Any]:
        """What DeepSpeed's load_checkpoint returns as client_state."""
        skip = set(ENGINE_KEYS) - ({"optimizer"} if not load_optimizer else set()) - (
            {"lr_scheduler"} if not load_scheduler else set())
        return {k: v for k, v in self.model_states.items() if k not in skip}


def tag_folder(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The folder of `tag` (None: the one `latest` names), or None without `latest`."""
    if tag is None:
        latest = os.path.join(load_dir, LATEST)
        if not os.path.isfile(latest):
            return None
        tag = open(latest, encoding="utf-8").read().strip()
    return os.path.join(load_dir, str(tag))


def is_deepspeed_folder(folder: str) -> bool:
    """Whether `folder` is a tag DeepSpeed (or ds_to_universal) wrote."""
    return any(os.path.isfile(os.path.join(folder, name)) for name in MODEL_STATES)


def read(folder: str, with_optimizer: bool = True) -> DeepSpeedCheckpoint:
    """Read and merge one tag folder (`with_optimizer`: the optimizer states too)."""
    model_states = _model_states(folder)
    module = dict(model_states.pop("module", None) or {})
    module.update(_layer_files(folder))
    universal = os.path.isdir(os.path.join(folder, UNIVERSAL))
    config = model_states.get("ds_config") or {}
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if universal:
        return _read_universal(folder, model_states, module, stage, with_optimizer)
    names = _trainable_names(model_states, module)
    ckpt = DeepSpeedCheckpoint(folder, False, stage, int(model_states.get("dp_world_size", 1)),
                               model_states, module,
                               {n: module[n].float() for n in names if module[n].numel()})
    shapes = model_states.get("param_shapes")
    if shapes and zero_shards.optimizer_files(folder):
        merged = zero_shards.merge_zero(folder, [dict(s) for s in shapes], with_optimizer)
        ckpt.weights.update(merged.weights)
        ckpt.states, ckpt.scalars = merged.states, merged.scalars
        ckpt.param_groups, ckpt.world_size = merged.param_groups, merged.world_size
        ckpt.loss_scale = merged.loss_scale
    elif model_states.get("optimizer") is not None:
        masters, ckpt.states, ckpt.scalars, ckpt.param_groups = zero_shards.split_stage0(
            model_states["optimizer"], names, {n: module[n].shape for n in names},
            with_optimizer)
        ckpt.weights.update(masters)
        ckpt.loss_scale = zero_shards.loss_scale_state(None, model_states["optimizer"])
    if with_optimizer and not ckpt.states:
        raise ValueError(f"{folder} holds no optimizer state (saved without an optimizer): "
                         f"pass load_optimizer_states=False")
    missing = [n for n in names if n not in ckpt.weights]
    if missing:
        raise ValueError(f"{folder} holds no weights for {missing[:3]}: ZeRO 3 keeps them in "
                         f"the optimizer files, which are missing; copy them into the folder")
    return ckpt


def _model_states(folder: str) -> Dict[str, Any]:
    """Rank 0's model states file (unpickled leniently: a Megatron-DeepSpeed run's args may
    name Megatron classes that are not installed here)."""
    from gigatron.models.megatron.files import load_rank_file

    for name in MODEL_STATES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return dict(load_rank_file(path))
    raise ValueError(f"{folder} is not a DeepSpeed checkpoint tag: it holds none of "
                     f"{', '.join(MODEL_STATES)}; give the folder save_checkpoint wrote to "
                     f"and the tag")


def _layer_files(folder: str) -> Tensors:
    """A PipelineModule's layers (`layer_XX-model_00-model_states.pt`), under the layer
    index as a prefix (the PipelineModule's own parameter names)."""
    out: Tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "layer_*-model_00-model_states.pt"))):
        match = _LAYER.search(os.path.basename(path))
        if match:
            layer = zero_shards.load_file(path)
            out.update({f"{int(match.group(1))}.{k}": v for k, v in layer.items()})
    return out


def _trainable_names(model_states: Dict[str, Any], module: Tensors) -> List[str]:
    """The optimizer's parameters by name: param_shapes' order (ZeRO), else the module's
    parameters (its state dict without buffers and frozen ones)."""
    shapes = model_states.get("param_shapes")
    if shapes:
        return [name for group in shapes for name in group]
    skip = set(model_states.get("buffer_names") or []) | set(
        model_states.get("frozen_param_shapes") or {})
    return [name for name in module if name not in skip]


def _read_universal(folder: str, model_states: Dict[str, Any], module: Tensors, stage: int,
                    with_optimizer: bool) -> DeepSpeedCheckpoint:
    """zero/<param>/<state>.pt: whole tensors, one folder per parameter."""
    root = os.path.join(folder, UNIVERSAL)
    ckpt = DeepSpeedCheckpoint(folder, True, stage, 1, model_states, module, {})
    for name in sorted(os.listdir(root)):
        param_dir = os.path.join(root, name)
        if not os.path.isdir(param_dir):
            continue
        for file in sorted(os.listdir(param_dir)):
            key = file[:-len(".pt")]
            value = zero_shards.load_file(os.path.join(param_dir, file))
            if key == "step":
                ckpt.scalars["step"] = value.item() if isinstance(value, torch.Tensor) else value
            elif key == "fp32":
                ckpt.weights[name] = value["param"].float()
            elif with_optimizer:
                ckpt.states.setdefault(key, {})[name] = value["param"].float()
    common = os.path.join(root, "optimizer_state.pt")
    if os.path.isfile(common):
        saved = zero_shards.load_file(common)
        ckpt.param_groups = [{k: v for k, v in g.items() if k != "params"}
                             for g in saved.get("param_groups", [])]
    if with_optimizer and not ckpt.states:
        raise ValueError(f"universal checkpoint {folder} holds no optimizer states (no "
                         f"zero/<param>/exp_avg.pt): pass load_optimizer_states=False")
    return ckpt
