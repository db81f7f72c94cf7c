"""Reading a Megatron-LM `torch`-format checkpoint folder, as Megatron-LM's save_checkpoint
lays it out (megatron/training/checkpointing.py):

    LOAD/latest_checkpointed_iteration.txt     "1000" or "release"
    LOAD/iter_0001000/mp_rank_TT/model_optim_rng.pt        pp = 1
    LOAD/iter_0001000/mp_rank_TT_PPP/model_optim_rng.pt    pp > 1  (release: LOAD/release/...)

Each file is a pickle of {'args': argparse.Namespace, 'checkpoint_version': 3.0, 'iteration',
'model' (or 'model0', 'model1', ... with a virtual pipeline), 'optimizer', 'rng_state', ...};
only the model chunks and the args are read here. With data parallelism only dp rank 0
writes the model. A Megatron checkpoint is a pickle: load only checkpoints you trust.
"""
from __future__ import annotations

import argparse
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from gigatron.models.hf_common import ConversionError, StateDict, require

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_CHUNK_KEY = re.compile(r"model(\d*)$")


@dataclass
class MegatronCheckpoint:
    """One iteration of a Megatron-LM torch checkpoint: its args and every rank's model."""

    folder: str
    args: argparse.Namespace
    checkpoint_version: float
    iteration: Optional[int]  # None for a release checkpoint
    tp: int
    pp: int
    models: Dict[Tuple[int, int], List[StateDict]]
    """(tp rank, pp rank) -> the rank's model chunks in virtual-pipeline order."""


class _Placeholder:
    """Stands in for a class the unpickler cannot import (a Megatron enum in the saved args
    when megatron is not installed): keeps what it was built from, for error messages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.args}>"


def placeholder_class(module: str, name: str) -> type:
    """A `_Placeholder` class named as the class `module.name` that cannot be imported."""
    return type(name, (_Placeholder,), {"__module__": module})


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return placeholder_class(module, name)


class LenientPickle:
    """A pickle module for torch.load whose Unpickler tolerates missing Megatron classes."""

    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    __name__ = "gigatron_lenient_pickle"


def read_tracker(root: str) -> str:
    """The iteration folder the tracker names (iter_XXXXXXX or release)."""
    path = os.path.join(root, TRACKER)
    require(os.path.isfile(path), f"{root} holds no {TRACKER} and no mp_rank_* folders: "
            f"give --load the folder Megatron-LM saved to (--save) or one iteration folder")
    text = open(path, encoding="utf-8").read().strip()
    if text == "release":
        return os.path.join(root, "release")
    require(text.isdigit(), f"{path} holds {text!r}, not an iteration number or 'release'")
    return os.path.join(root, f"iter_{int(text):07d}")


def iteration_folder(load: str) -> str:
    """The folder holding the mp_rank_* directories: `load` itself or the one its tracker
    names."""
    if _rank_dirs(load):
        return load
    folder = read_tracker(load)
    require(os.path.isdir(folder), f"{os.path.join(load, TRACKER)} names {folder}, which does "
            f"not exist")
    return folder


def _rank_dirs(folder: str) -> Dict[str, Tuple[int, Optional[int], Optional[int]]]:
    if not os.path.isdir(folder):
        return {}
    out = {}
    for name in os.listdir(folder):
        match = _RANK_DIR.match(name)
        if match:
            out[name] = tuple(None if g is None else int(g) for g in match.groups())
    return out  # type: ignore[return-value]


def _refuse_other_formats(folder: str) -> None:
    names = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    if "common.pt" in names or any(n.endswith(".distcp") for n in names):
        raise ConversionError(
            f"{folder} is a Megatron torch_dist checkpoint, not the torch format: read it "
            f"with gigatron.models.megatron.torch_dist.read_torch_dist (`gigatron convert "
            f"megatron-to-gigatron` tells the formats apart)")
    raise ConversionError(f"{folder} holds no mp_rank_* folders: not a Megatron-LM torch "
                          f"checkpoint")


def load_rank_file(path: str) -> Dict[str, Any]:
    """One model_optim_rng.pt, memory-mapped (the optimizer state is never read)."""
    require(os.path.isfile(path), f"{path} is missing: the checkpoint is incomplete")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True,
                          pickle_module=LenientPickle)
    except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as err:
        raise ConversionError(f"{path} cannot be read ({str(err).splitlines()[0]}): the file "
                              f"is truncated or not a torch checkpoint") from None


def model_chunks(state: Dict[str, Any], path: str) -> List[StateDict]:
    """The file's model state dicts in virtual-pipeline order ('model' or model0, model1...)."""
    keys = {int(m.group(1) or -1): k for k in state if (m := _CHUNK_KEY.match(k))}
    require(keys, f"{path} holds no 'model' entry (keys: {', '.join(map(str, state))})")
    if -1 in keys:
        require(len(keys) == 1, f"{path} holds both 'model' and 'model0'...: damaged")
        return [state["model"]]
    require(sorted(keys) == list(range(len(keys))),
            f"{path} holds model chunks {sorted(keys)}, not 0..{len(keys) - 1}")
    return [state[keys[i]] for i in range(len(keys))]


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int) -> str:
    """mp_rank_TT without pipeline parallelism, mp_rank_TT_PPP with (Megatron's naming)."""
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _sizes(args: argparse.Namespace, first: str) -> Tuple[int, int]:
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    ep = int(getattr(args, "expert_model_parallel_size", 1) or 1)
    require(ep == 1, f"{first}: expert_model_parallel_size={ep}: mixture-of-experts "
            f"checkpoints are not supported")
    return tp, pp


def read_checkpoint(load: str) -> MegatronCheckpoint:
    """Every rank's model and the saved args of the checkpoint in `load` (a --save folder
    with its tracker, or one iteration folder)."""
    folder = iteration_folder(load)
    dirs = _rank_dirs(folder)
    if not dirs:
        _refuse_other_formats(folder)
    first = os.path.join(folder, sorted(dirs)[0], RANK_FILE)
    head = load_rank_file(first)
    args = head.get("args")
    if not isinstance(args, argparse.Namespace):
        raise ConversionError(f"{first} holds no 'args': the model's shape cannot be known")
    version = float(head.get("checkpoint_version", 0) or 0)
    require(version >= 3.0, f"{first}: checkpoint_version {version} predates Megatron-Core "
            f"(3.0); convert it with the Megatron-LM release that wrote it")
    tp, pp = _sizes(args, first)
    expected = {rank_dir_name(t, p, pp) for t in range(tp) for p in range(pp)}
    require(set(dirs) == expected, f"{folder} holds {', '.join(sorted(dirs))} but its args "
            f"say tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp} "
            f"({', '.join(sorted(expected))})")
    models = {}
    for t in range(tp):
        for p in range(pp):
            path = os.path.join(folder, rank_dir_name(t, p, pp), RANK_FILE)
            state = head if path == first else load_rank_file(path)
            models[(t, p)] = model_chunks(state, path)
    vp = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    bad = sorted({len(chunks) for chunks in models.values()} - {vp})
    require(not bad, f"{folder}: a rank holds {bad[0] if bad else vp} model chunks but the "
            f"args say virtual_pipeline_model_parallel_size={vp}")
    iteration = head.get("iteration")
    return MegatronCheckpoint(folder, args, version,
                              None if os.path.basename(folder) == "release" else iteration,
                              tp, pp, models)
