"""Megatron-Core `torch_dist` checkpoints (Megatron-LM's default `--ckpt-format`) -> gigatron's
single-device state dicts, with the optimizer state when it is saved per parameter.

Megatron-LM's save_checkpoint hands megatron.core.dist_checkpointing a sharded state dict:

    LOAD/latest_checkpointed_iteration.txt     "1000" or "release"
    LOAD/iter_0001000/.metadata                torch.distributed.checkpoint's: global shapes
    LOAD/iter_0001000/__R_N.distcp             what each rank wrote
    LOAD/iter_0001000/common.pt                args, iteration, checkpoint_version,
                                               opt_param_scheduler, the optimizer's param
                                               groups (with the step count)
    LOAD/iter_0001000/metadata.json            {"sharded_backend": "torch_dist", ...}

Tensors are global whatever tp / pp saved them, so no layout is needed to read them (torch's
DCP reader, in one process). Megatron-Core's names: the transformer layers are stacked along
a first layer axis (`decoder.layers.self_attention.linear_qkv.weight` [layers, ...]), the
norms carry the transformer_engine names (`linear_qkv.layer_norm_weight`), SwiGLU's fc1 is
saved as [gate; up] and the fused QKV per query group, both gigatron's layouts already. The
vocabulary is Megatron's padded table.

Optimizer: per-parameter formats (`optimizer.state.<exp_avg|exp_avg_sq|param|fp32_param>.
<model key>`: the distributed optimizer's `fully_reshardable` and the older
`fully_sharded_model_space`, and the non-distributed optimizer) map like the weights. The
distributed optimizer's `dp_reshardable` format (Megatron-LM's default unless
--dist-ckpt-optim-fully-reshardable) stores its gradient-buffer buckets: cut back into
parameters by buckets.py. The deprecated bucket formats (`dp_zero_gather_scatter`,
`fully_sharded_bucket_space`) are refused. Mixture-of-experts layers: moe.py.
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, StateDict, require
from gigatron.models.megatron.args import config_from_megatron_args, vocab_sizes
from gigatron.models.megatron.files import LenientPickle, read_tracker, TRACKER
from gigatron.models.megatron.legacy import megatron_state_dict

COMMON_FILE = "common.pt"
DCP_METADATA = ".metadata"
_STACKED = "decoder.layers."
_OPTIMIZER = re.compile(r"^(?:chained_\d+\.)?optimizer\.state\.([A-Za-z0-9_]+)\.(.+)$")
_MASTER_NAMES = ("param", "fp32_param")  # fully_reshardable / the others
MASTER = "master"


@dataclass
class MegatronOptimizerState:
    """The optimizer state of a Megatron checkpoint, under gigatron's parameter names."""

    per_element: Dict[str, StateDict]  # "exp_avg" / "exp_avg_sq" -> name -> tensor
    masters: StateDict  # fp32 main parameters
    step: int
    sharding_type: str


@dataclass
class TorchDistCheckpoint:
    """One iteration of a Megatron-Core torch_dist checkpoint, read into gigatron's names."""

    folder: str
    args: argparse.Namespace
    iteration: int  # 0 for a release checkpoint
    config: TransformerConfig
    model: StateDict
    optimizer: Optional[MegatronOptimizerState]
    scheduler: Dict[str, Any] = field(default_factory=dict)  # Megatron's opt_param_scheduler


def is_torch_dist(folder: str) -> bool:
    """Whether `folder` is one iteration of a Megatron-Core torch_dist checkpoint."""
    return os.path.isfile(os.path.join(folder, COMMON_FILE)) and \
        os.path.isfile(os.path.join(folder, DCP_METADATA))


def find_torch_dist(load: str) -> Optional[str]:
    """The iteration folder of a Megatron torch_dist checkpoint in `load` (a --save root
    with its tracker, or one iteration folder); None if `load` holds none."""
    if is_torch_dist(load):
        return load
    if not os.path.isfile(os.path.join(load, TRACKER)):
        return None
    try:
        folder = read_tracker(load)
    except ConversionError:
        return None
    return folder if is_torch_dist(folder) else None


def read_common(folder: str) -> Dict[str, Any]:
    """common.pt: the args, iteration, scheduler and optimizer param groups (a pickle:
    load only checkpoints you trust)."""
    path = os.path.join(folder, COMMON_FILE)
    try:
        common = torch.load(path, map_location="cpu", weights_only=False,
                            pickle_module=LenientPickle)
    except (RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        raise ConversionError(f"{path} cannot be read ({_first_line(err)}): the file is "
                              f"truncated or not a torch checkpoint") from None
    require(isinstance(common.get("args"), argparse.Namespace), f"{path} holds no 'args': "
            f"the model's shape cannot be known")
    return common


def _first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [type(err).__name__])[0]


def _read_tensors(folder: str, wanted: Any) -> Dict[str, torch.Tensor]:
    """Every global tensor whose key `wanted(key)` accepts, read whole in this process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(folder)
    try:
        entries = reader.read_metadata().state_dict_metadata
    except Exception as err:  # pickle, EOF, OS errors: the file is damaged
        raise ConversionError(f"{os.path.join(folder, DCP_METADATA)} cannot be read "
                              f"({_first_line(err)}): the file is truncated or damaged") \
            from None
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for k, md in entries.items()
             if isinstance(md, TensorStorageMetadata) and wanted(k)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return state


def read_objects(folder: str, prefix: Tuple[str, ...]) -> Dict[str, Any]:
    """The pickled objects (ShardedObjects) whose key starts with one of `prefix`."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    reader = dcp.FileSystemReader(folder)
    state: Dict[str, Any] = {k: io.BytesIO() for k, md in
                             reader.read_metadata().state_dict_metadata.items()
                             if isinstance(md, BytesStorageMetadata) and k.startswith(prefix)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return state


def unstack_layers(state: StateDict, num_layers: int) -> StateDict:
    """Megatron-Core's layer-stacked `decoder.layers.<name>` [layers, ...] -> one tensor per
    `decoder.layers.<i>.<name>`."""
    out: StateDict = {}
    for key, tensor in state.items():
        if not key.startswith(_STACKED) or key[len(_STACKED)].isdigit():
            out[key] = tensor
            continue
        inner = key[len(_STACKED):]
        require(tensor.shape[0] == num_layers, f"{key} stacks {tensor.shape[0]} layers, the "
                f"args say num_layers={num_layers}")
        for i in range(num_layers):
            out[f"{_STACKED}{i}.{inner}"] = tensor[i]
    return out


def _to_gigatron(state: StateDict, config: TransformerConfig, padded: int,
                 buffers: bool = True) -> StateDict:
    """Megatron-Core global tensors -> gigatron's single-device state dict (names, padding;
    `buffers` False: an optimizer's state, none for the model's buffers)."""
    layers = unstack_layers(state, config.num_layers)
    return megatron_state_dict({(0, 0): [layers]}, 1, 1, config, padded, buffers)


def optimizer_step(common: Dict[str, Any], folder: str) -> int:
    """The optimizer's step count: the distributed optimizer keeps it in every param group,
    the non-distributed one as the state's `common_step`."""
    steps = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for group in node.get("param_groups") or []:
                if isinstance(group, dict) and "step" in group:
                    steps.add(int(group["step"]))
            state = node.get("state")
            if isinstance(state, dict) and "common_step" in state:
                steps.add(int(state["common_step"]))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):  # a ShardedObject's value
            for value in node:
                walk(value)
    walk(common.get("optimizer"))
    require(len(steps) == 1, f"{folder}/{COMMON_FILE}: the optimizer's param groups hold "
            f"step counts {sorted(steps) or 'none'}, one expected: add --no-load-optim to "
            f"take the weights only")
    return steps.pop()


def sharding_type(common: Dict[str, Any]) -> str:
    """The distributed optimizer's checkpoint format ('' for the non-distributed one)."""
    found: List[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "param_state_sharding_type" in node:
                found.append(str(node["param_state_sharding_type"]))
            for value in node.values():
                walk(value)
    walk(common.get("optimizer"))
    return found[0] if found else ""


def check_optimizer_format(common: Dict[str, Any], folder: str) -> None:
    """Refuse the distributed optimizer's deprecated formats (before reading anything)."""
    kind = sharding_type(common)
    require(kind not in ("dp_zero_gather_scatter", "fully_sharded_bucket_space"),
            f"{folder}: the distributed optimizer's state is saved as {kind!r} (a deprecated "
            f"format, tied to the saving run's layout): resave it from Megatron-LM with "
            f"--dist-ckpt-optim-fully-reshardable, or add --no-load-optim to take the weights "
            f"and start the optimizer afresh")


def read_optimizer(folder: str, common: Dict[str, Any], optim: Dict[str, torch.Tensor],
                   config: TransformerConfig, padded: int,
                   model: Dict[str, Tuple[Tuple[int, ...], torch.dtype]]
                   ) -> MegatronOptimizerState:
    """The optimizer state under gigatron's names (`optim`: the checkpoint's optimizer
    tensors by key; `model`: its model tensors' global shapes and dtypes, in its order)."""
    kind = sharding_type(common)
    if kind == "dp_reshardable":
        from gigatron.models.megatron.buckets import bucket_states

        mapped = bucket_states(optim, model, common["args"], config, padded, folder)
        # its param groups (with the step count) are objects beside the buckets
        common = {**common, "optimizer": {"common": common.get("optimizer"), **read_objects(
            folder, ("optimizer.distributed.", "chained_"))}}
    else:
        by_state: Dict[str, StateDict] = {}
        for key, tensor in optim.items():
            match = _OPTIMIZER.match(key)
            if match:
                name = MASTER if match.group(1) in _MASTER_NAMES else match.group(1)
                by_state.setdefault(name, {})[match.group(2)] = tensor
        mapped = {name: _to_gigatron(state, config, padded, buffers=False)
                  for name, state in by_state.items()}
    mapped = {MASTER if k in _MASTER_NAMES else k: v for k, v in mapped.items()}
    require(bool(mapped), f"{folder} holds no optimizer state a parameter's tensors can be "
            f"told from: add --no-load-optim to take the weights only")
    masters = mapped.pop(MASTER, {})
    return MegatronOptimizerState({k: mapped[k] for k in sorted(mapped)},
                                  {k: v.float() for k, v in masters.items()},
                                  optimizer_step(common, folder), kind or "per-parameter")


def read_torch_dist(load: str, vocab_size: Optional[int] = None, with_optimizer: bool = True
                    ) -> TorchDistCheckpoint:
    """A Megatron-Core torch_dist checkpoint (a --save root or one iteration folder) at any
    tp / pp it was saved with: config, weights and (unless `with_optimizer` is False, or none
    was saved) the optimizer state, all in gigatron's single-device names."""
    folder = find_torch_dist(load)
    require(folder is not None, f"{load} holds no Megatron torch_dist checkpoint (no "
            f"{TRACKER} naming a folder with {COMMON_FILE} and {DCP_METADATA})")
    assert folder is not None
    common = read_common(folder)
    args = common["args"]
    config = config_from_megatron_args(args, vocab_size)
    _, padded = vocab_sizes(args, vocab_size)
    if with_optimizer:
        check_optimizer_format(common, folder)
    tensors = _read_tensors(folder, lambda k: not k.startswith("rng_state") and (
        with_optimizer or not k.startswith(("optimizer.", "chained_"))))
    optim = {k: tensors.pop(k) for k in list(tensors) if k.startswith(("optimizer.",
                                                                        "chained_"))}
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}
    model = _to_gigatron(tensors, config, padded)
    config.params_dtype = model["embedding.word_embeddings.weight"].dtype
    optimizer = None
    if with_optimizer and (optim or common.get("optimizer")):
        optimizer = read_optimizer(folder, common, optim, config, padded, shapes)
    iteration = 0 if os.path.basename(os.path.normpath(folder)) == "release" else \
        int(common.get("iteration") or 0)
    return TorchDistCheckpoint(folder, args, iteration, config, model, optimizer,
                               dict(common.get("opt_param_scheduler") or {}))
