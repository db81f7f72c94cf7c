"""DeepSpeed's ZeRO optimizer files merged into whole tensors, whatever world size saved them.

Facts of DeepSpeed 0.19's layout (runtime/engine.py `_save_zero_checkpoint`, its ZeRO
optimizers' `state_dict`, utils/zero_to_fp32.py):

- ZeRO 1/2 (and the bf16 optimizer): `[bf16_]zero_pp_rank_<R>_mp_rank_<M>_optim_states.pt`
  per dp rank R (of model-parallel rank M: reader.py) holds, per param group, a flat fp32 partition
  (`single_partition_of_fp32_groups`) and the base optimizer's state of that partition
  (`base_optimizer_state`: exp_avg, exp_avg_sq shaped like it, a step count). The ranks'
  partitions, concatenated, are the group's parameters flattened in the order of
  `param_shapes` (model states file), each followed by `param_alignment_paddings` elements,
  the group padded at the end.
- ZeRO 3: the same files hold `fp32_flat_groups` and the base optimizer's state dict
  (`optimizer_state_dict`); every parameter is split on its own: each rank holds
  ceil(numel / world) of its elements (the last rank padded), the parameters one after
  another in `param_shapes` order across the groups.
- ZeRO 0: no optimizer file; the model states file's `optimizer` is the torch optimizer's
  state dict (fp32), or the fp16/bf16 wrapper's holding it with the fp32 masters: one per
  parameter (`fp32_groups`, the unfused wrapper bf16 gets) or one flat per group
  (`fp32_groups_flat`, the fused one).
"""
from __future__ import annotations

import glob
import math
import os
import pickle
import re
from typing import Any, Dict, List, Sequence, Tuple

import torch

from gigatron.training.checkpoint.deepspeed.pickled import DeepSpeedPickle

Tensors = Dict[str, torch.Tensor]
Shapes = List[Dict[str, torch.Size]]  # per param group, in the flattened order
_RANK = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


class MergedZero:
    """Whole fp32 weights and per-element optimizer states by parameter name, plus the
    optimizer's scalar state (the step count) and its param groups' options."""

    def __init__(self, weights: Tensors, states: Dict[str, Tensors], scalars: Dict[str, Any],
                 param_groups: List[Dict[str, Any]], world_size: int,
                 loss_scale: Dict[str, Any]) -> None:
        self.weights, self.states, self.scalars = weights, states, scalars
        self.param_groups, self.world_size, self.loss_scale = param_groups, world_size, \
            loss_scale


def optimizer_files(folder: str, mp_rank: int = 0) -> List[str]:
    """The ZeRO optimizer files of one model-parallel rank of a tag folder, by dp rank (empty
    at ZeRO 0)."""
    found = {}
    for path in glob.glob(os.path.join(folder, "*_optim_states.pt")):
        match = _RANK.search(os.path.basename(path))
        if match and int(match.group(2)) == mp_rank:
            found[int(match.group(1))] = path
    ranks = sorted(found)
    _check_ranks(folder, ranks, max(ranks, default=-1) + 1)
    return [found[r] for r in ranks]


def _check_ranks(folder: str, ranks: List[int], world: int) -> None:
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise ValueError(f"{folder} lacks the ZeRO optimizer files of dp ranks {missing}: the "
                         f"save did not finish on every rank; load an earlier tag")


def load_file(path: str, mmap: bool = False) -> Any:
    """One torch file of the checkpoint (DeepSpeed's classes as stand-ins: deepspeed need
    not be installed, pickled.py); a damaged one is a ValueError naming it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=mmap,
                          pickle_module=DeepSpeedPickle)
    except (RuntimeError, EOFError, pickle.UnpicklingError, OSError) as err:
        reason = str(err).splitlines()[0].split(". ")[0]
        raise ValueError(f"{path} cannot be read ({reason}): the file is truncated or "
                         f"damaged; load an earlier tag") from None


def merge_zero(folder: str, param_shapes: Shapes, with_states: bool,
               mp_rank: int = 0) -> MergedZero:
    """Read every dp rank's optimizer file of one model-parallel rank of a ZeRO 1-3
    checkpoint and merge them."""
    files = optimizer_files(folder, mp_rank)
    shards = [load_file(f)["optimizer_state_dict"] for f in files]
    stage = int(shards[0].get("zero_stage", 1))  # the bf16 optimizer (ZeRO 1) names none
    count = shards[0].get("partition_count", len(files))  # ZeRO 1/2: one per group
    _check_ranks(folder, list(range(len(files))),
                 max(count) if isinstance(count, (list, tuple)) else int(count))
    if stage == 3:
        flats = [shard["fp32_flat_groups"] for shard in shards]
        base = [shard["optimizer_state_dict"] for shard in shards]
        split = _split_stage3
    else:
        flats = [shard["single_partition_of_fp32_groups"] for shard in shards]
        base = [shard["base_optimizer_state"] for shard in shards]
        split = _split_stage12
    paddings = shards[0].get("param_alignment_paddings")
    weights = split(flats, param_shapes, paddings)
    states: Dict[str, Tensors] = {}
    scalars: Dict[str, Any] = {}
    if with_states:
        per_rank = [_per_group_states(b, len(flats[0]), f) for b, f in zip(base, files)]
        for key in per_rank[0][0]:
            states[key] = split([[group[key] for group in rank] for rank in per_rank],
                                param_shapes, paddings)
        scalars = _scalars(base[0])
    groups = [{k: v for k, v in g.items() if k != "params"} for g in base[0]["param_groups"]]
    return MergedZero(weights, states, scalars, groups, len(files),
                      loss_scale_state(shards[0].get("loss_scaler"), shards[0]))


def loss_scale_state(scaler: Any, wrapper: Dict[str, Any]) -> Dict[str, Any]:
    """DeepSpeed's loss scaler (ZeRO: the pickled scaler object; ZeRO 0's fp16 wrapper: its
    cur_scale, cur_iter, ... keys) in gigatron's scaler state names; {} without one."""
    def get(name: str) -> Any:
        return getattr(scaler, name, None) if scaler is not None else wrapper.get(name)
    state = {"scale": get("cur_scale"), "iteration": get("cur_iter"),
             "last_overflow_iteration": get("last_overflow_iter"),
             "hysteresis_left": get("cur_hysteresis")}
    return {k: v for k, v in state.items() if v is not None}


def _per_group_states(base: Dict[str, Any], groups: int, path: str) -> List[Tensors]:
    """The per-element states (tensors shaped like the flat partition) of each group."""
    state = base.get("state", {})
    out = []
    for g in range(groups):
        if g not in state:
            raise ValueError(f"{path} holds no optimizer state for param group {g} (saved "
                             f"before the first step?): pass load_optimizer_states=False")
        out.append({k: v for k, v in state[g].items()
                    if isinstance(v, torch.Tensor) and v.dim() == 1})
    return out


def _scalars(base: Dict[str, Any]) -> Dict[str, Any]:
    """The base optimizer's scalar state (step), the same for every group."""
    first = base.get("state", {}).get(0, {})
    return {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in first.items()
            if not (isinstance(v, torch.Tensor) and v.dim() == 1)}


def _split_stage12(flats: Sequence[Sequence[torch.Tensor]], param_shapes: Shapes,
                   paddings: Any) -> Tensors:
    """ZeRO 1/2: per group, the ranks' partitions end to end, cut in parameter order."""
    out: Tensors = {}
    for index, shapes in enumerate(param_shapes):
        full = torch.cat([rank[index].detach().float().reshape(-1) for rank in flats])
        pads = paddings[index] if paddings is not None else [0] * len(shapes)
        offset = 0
        for (name, shape), pad in zip(shapes.items(), pads):
            numel = math.prod(shape)
            if offset + numel > full.numel():
                raise ValueError(_mismatch(name, full.numel(), offset + numel))
            out[name] = full[offset:offset + numel].view(shape).clone()
            offset += numel + int(pad)
    return out


def _split_stage3(flats: Sequence[Sequence[torch.Tensor]], param_shapes: Shapes,
                  paddings: Any) -> Tensors:
    """ZeRO 3: each parameter is ceil(numel / world) elements of every rank's flat groups."""
    world = len(flats)
    per_rank = [torch.cat([g.detach().float().reshape(-1) for g in rank]) for rank in flats]
    out: Tensors = {}
    offset = 0
    for name, shape in ((n, s) for shapes in param_shapes for n, s in shapes.items()):
        numel = math.prod(shape)
        part = math.ceil(numel / world)
        if offset + part > per_rank[0].numel():
            raise ValueError(_mismatch(name, per_rank[0].numel() * world, (offset + part) * world))
        pieces = [rank[offset:offset + part] for rank in per_rank]
        out[name] = torch.cat(pieces)[:numel].view(shape).clone()
        offset += part
    return out


def _mismatch(name: str, held: int, needed: int) -> str:
    return (f"the ZeRO partitions hold {held} elements, the saved param_shapes need {needed} "
            f"(at {name!r}): the optimizer files and the model states file are of different "
            f"saves; load a tag whose files are all from one save")


def split_stage0(optimizer: Dict[str, Any], names: List[str], shapes: Dict[str, torch.Size],
                 with_states: bool
                 ) -> Tuple[Tensors, Dict[str, Tensors], Dict[str, Any], List[Dict[str, Any]]]:
    """ZeRO 0: (fp32 masters if the fp16/bf16 wrapper kept them, else {}; per-element
    states; scalars; param group options). Its torch state dict numbers the parameters in
    the order given to the optimizer, taken here as `names` (model.parameters() order)."""
    base = optimizer.get("optimizer_state_dict", optimizer)
    groups = base["param_groups"]
    if "fp32_groups_flat" in optimizer:
        return _split_stage0_flat(optimizer, base, names, shapes, with_states)
    indices = [i for g in groups for i in g["params"]]
    flat = [t for group in optimizer.get("fp32_groups", []) for t in group]  # unfused wrapper
    if len(indices) != len(names) or (flat and len(flat) != len(names)):
        raise ValueError(f"the ZeRO 0 optimizer state has {len(indices)} parameters, the saved "
                         f"module {len(names)} trainable ones: their order cannot be matched; "
                         f"pass load_optimizer_states=False to load the weights")
    masters = {n: t.detach().float().clone() for n, t in zip(names, flat)}
    states: Dict[str, Tensors] = {}
    scalars: Dict[str, Any] = {}
    for name, index in zip(names, indices) if with_states else ():
        for key, value in base["state"].get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                states.setdefault(key, {})[name] = value.detach().float().clone()
            else:
                scalars[key] = value.item() if isinstance(value, torch.Tensor) else value
    return masters, states, scalars, _options(groups)


def _split_stage0_flat(optimizer: Dict[str, Any], base: Dict[str, Any], names: List[str],
                       shapes: Dict[str, torch.Size], with_states: bool
                       ) -> Tuple[Tensors, Dict[str, Tensors], Dict[str, Any],
                                  List[Dict[str, Any]]]:
    """The fused fp16 wrapper: one flat fp32 master (and state) per param group."""
    groups = base["param_groups"]
    if len(groups) != 1:
        raise ValueError(f"a ZeRO 0 fp16 checkpoint with {len(groups)} param groups does not "
                         f"say which parameter is in which group: pass "
                         f"load_optimizer_states=False to load the weights")
    flat_shapes = [{name: shapes[name] for name in names}]
    masters = _split_stage12([optimizer["fp32_groups_flat"]], flat_shapes, None)
    per_group = _per_group_states(base, 1, "the model states file") if with_states else [{}]
    states = {key: _split_stage12([[per_group[0][key]]], flat_shapes, None)
              for key in per_group[0]}
    return masters, states, _scalars(base), _options(groups)


def _options(groups: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups]
