"""Nested checkpoint state <-> one safetensors file (--ckpt-format safetensors).

Tensors (and numpy arrays) are stored as safetensors entries named by their path; the
structure around them (dicts, lists, tuples, numbers, strings) goes into the header's
metadata as JSON, so loading never unpickles anything.
"""
from __future__ import annotations

import json
from typing import Any, Dict

import numpy as np
import torch

_KEY = "gigatron_structure"


def _encode(obj: Any, path: str, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        tensors[path] = obj.detach().cpu().contiguous()
        return {"__tensor__": path}
    if isinstance(obj, np.ndarray):
        tensors[path] = torch.from_numpy(np.ascontiguousarray(obj))
        return {"__ndarray__": path}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise ValueError(f"safetensors checkpoint: keys at {path!r} must be str or int")
        return {"__dict__": [[k, _encode(v, f"{path}.{k}", tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ValueError(f"safetensors checkpoint cannot store {type(obj).__name__} at {path!r}: "
                     f"use --ckpt-format torch")


def _decode(obj: Any, tensors: Dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj:
        return tensors[obj["__tensor__"]]
    if "__ndarray__" in obj:
        return tensors[obj["__ndarray__"]].numpy()
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors) for v in obj["__tuple__"])
    return {k: _decode(v, tensors) for k, v in obj["__dict__"]}


def dumps_state(state: Dict[str, Any]) -> bytes:
    """A nested state (tensors anywhere inside) as the bytes of a safetensors file."""
    from safetensors.torch import save

    tensors: Dict[str, torch.Tensor] = {}
    structure = _encode(state, "s", tensors)
    # safetensors refuses tensors sharing memory; checkpoints own their copies anyway
    tensors = {k: v.clone() for k, v in tensors.items()}
    return save(tensors, metadata={_KEY: json.dumps(structure)})


def save_state(state: Dict[str, Any], path: str) -> None:
    """Write a nested state (tensors anywhere inside) to a safetensors file."""
    data = dumps_state(state)
    with open(path, "wb") as f:
        f.write(data)


def load_state(path: str) -> Dict[str, Any]:
    """Read a file written by `save_state`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        structure = json.loads(f.metadata()[_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(structure, tensors)
