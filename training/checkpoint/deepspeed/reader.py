"""One DeepSpeed checkpoint tag, read whole: what a gigatron engine or converter needs.

    SAVE_DIR/latest                                          the newest tag
    SAVE_DIR/<tag>/mp_rank_<M>_model_states.pt               module, counters, lr_scheduler,
                                                             param_shapes, ds_config, client keys
    SAVE_DIR/<tag>/zero_pp_rank_<R>_mp_rank_<M>_model_states.pt   (ZeRO 3: one per rank)
    SAVE_DIR/<tag>/[bf16_]zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt  ZeRO shards (1-3)
    SAVE_DIR/<tag>/layer_<L>[-model_<T>]-model_states.pt     a PipelineModule's layers

M is DeepSpeed's model-parallel rank (`checkpoint_mp_rank`, 00 without one). The plain engine
takes it from the user's mpu: Megatron-DeepSpeed's is the tensor-parallel rank (its mpu
allows no pipeline there). The pipeline engine takes it from the PipelineModule's grid: the
rank's index among its data-parallel replica's ranks, stage x tp + tp rank, and its layer
files name the tp rank T (`-model_<T>`) only when the topology has a 'model' axis
(Megatron-DeepSpeed's PipeModelDataParallelTopology; a plain PipelineModule's has none).

DeepSpeed's universal checkpoint (`ds_to_universal --output_folder SAVE_DIR/<tag>`) is a tag
folder with the model states file and `zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt`
(whole tensors under the module's names) and `zero/optimizer_state.pt` (param groups).

The ZeRO shards are merged here (zero_shards.py), so any world size loads what any world
size saved. `read` reads a plain module's tag whole, a pipeline's stages together; a plain
module has no tensor-parallel split to merge (DeepSpeed's engine saves tp > 1 only for
Megatron-style models, through their mpu), so such a tag is refused there and read per tp
rank by `read_tensor_parallel` for the Megatron-DeepSpeed converter (convert.py), which
knows the split from the model's names.
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
_LAYER = re.compile(r"layer_(\d+)-(?:model_(\d+)-)?model_states\.pt$")
_MP_RANK = re.compile(r"(?:zero_pp_rank_0_)?mp_rank_(\d+)_model_states\.pt$")
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
    """Read and merge one tag folder of a plain module (`with_optimizer`: the optimizer
    states too): a pipeline's stages together; tensor-parallel saves are refused."""
    ranks = model_parallel_ranks(folder)
    if len(ranks) == 1:
        return read_rank(folder, with_optimizer)
    tp_ranks = layer_tp_ranks(folder)
    if len(tp_ranks) != 1:  # no layer files: the plain engine, whose mpu is tensor-parallel
        raise ValueError(
            f"{folder} was saved by {len(ranks)} model-parallel ranks with tensor parallelism: "
            f"a plain module has no tensor-parallel split to merge them by (DeepSpeed saves "
            f"tp > 1 only for Megatron-style models, through their mpu); a Megatron-DeepSpeed "
            f"GPT converts with `gigatron convert deepspeed-to-gigatron`")
    return _union([read_rank(folder, with_optimizer, stage) for stage in ranks])


def read_tensor_parallel(folder: str, with_optimizer: bool, tp: int, pp: int
                         ) -> List[DeepSpeedCheckpoint]:
    """Per tp rank, every stage's tensors of a Megatron-DeepSpeed tag saved at `tp` x `pp`
    (model-parallel rank stage x tp + tp rank), still split as that tp rank holds them."""
    ranks = model_parallel_ranks(folder)
    if len(ranks) != tp * pp:
        raise ValueError(f"{folder} holds the model states of {len(ranks)} model-parallel "
                         f"ranks, but its args say tensor_model_parallel_size={tp} x "
                         f"pipeline_model_parallel_size={pp}: the tag is incomplete or not "
                         f"of this run")
    return [_union([read_rank(folder, with_optimizer, stage * tp + t, t) for stage in range(pp)])
            for t in range(tp)]


def model_parallel_ranks(folder: str) -> List[int]:
    """The model-parallel ranks whose model states files the tag holds: 0..n-1."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    ranks = sorted({int(m.group(1)) for n in names if (m := _MP_RANK.match(n))})
    if ranks != list(range(len(ranks))) or not ranks:
        raise ValueError(f"{folder} holds the model states files of model-parallel ranks "
                         f"{ranks}, not 0..{max(ranks, default=0)}: the save did not finish "
                         f"on every rank; load an earlier tag")
    return ranks


def layer_tp_ranks(folder: str) -> List[int]:
    """The tp ranks a pipeline's layer files name ([0] without a 'model' axis; [] when the
    tag has no layer files)."""
    matches = [_LAYER.match(n) for n in os.listdir(folder)]
    return sorted({int(m.group(2) or 0) for m in matches if m})


def _union(parts: List[DeepSpeedCheckpoint]) -> DeepSpeedCheckpoint:
    """One checkpoint of a pipeline's stages (the first's counters, groups and scaler): each
    stage's tensors under their names; a tied module's copies are equal, the first kept."""
    whole = parts[0]
    for part in parts[1:]:
        whole.weights = {**part.weights, **whole.weights}
        whole.module = {**part.module, **whole.module}
        for key, tensors in part.states.items():
            whole.states[key] = {**tensors, **whole.states.get(key, {})}
    return whole


def read_rank(folder: str, with_optimizer: bool = True, mp_rank: int = 0,
              tp_rank: int = 0) -> DeepSpeedCheckpoint:
    """One model-parallel rank's part of a tag: its model states file, its ZeRO shards
    merged, and the layer files of its tp rank (a pipeline's: every stage's)."""
    model_states = read_model_states(folder, mp_rank)
    module = dict(model_states.pop("module", None) or {})
    module.update(_layer_files(folder, tp_rank))
    universal = os.path.isdir(os.path.join(folder, UNIVERSAL))
    config = model_states.get("ds_config") or {}
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if universal:
        return _read_universal(folder, model_states, module, stage, with_optimizer)
    names = _trainable_names(model_states, module)
    ckpt = DeepSpeedCheckpoint(folder, False, stage, int(model_states.get("dp_world_size", 1)),
                               model_states, module,
                               {n: module[n].float() for n in names
                                if n in module and module[n].numel()})
    shapes = model_states.get("param_shapes")
    if shapes and zero_shards.optimizer_files(folder, mp_rank):
        merged = zero_shards.merge_zero(folder, [dict(s) for s in shapes], with_optimizer,
                                        mp_rank)
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


def read_model_states(folder: str, mp_rank: int = 0) -> Dict[str, Any]:
    """A model-parallel rank's model states file, memory-mapped (unpickled leniently: a
    Megatron-DeepSpeed run's args may name Megatron classes, and its objects DeepSpeed's,
    that are not installed here)."""
    for name in MODEL_STATES:
        path = os.path.join(folder, name.replace("mp_rank_00", f"mp_rank_{mp_rank:02d}"))
        if os.path.isfile(path):
            return dict(zero_shards.load_file(path, mmap=True))
    raise ValueError(f"{folder} is not a DeepSpeed checkpoint tag: it holds none of "
                     f"{', '.join(MODEL_STATES)}; give the folder save_checkpoint wrote to "
                     f"and the tag")


def _layer_files(folder: str, tp_rank: int = 0) -> Tensors:
    """A PipelineModule's layers of one tp rank (`layer_XX[-model_TT]-model_states.pt`),
    under the layer index as a prefix (the PipelineModule's own parameter names)."""
    out: Tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "layer_*-model_states.pt"))):
        match = _LAYER.search(os.path.basename(path))
        if match and int(match.group(2) or 0) == tp_rank:
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
