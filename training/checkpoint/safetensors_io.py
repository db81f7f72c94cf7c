"""Nested checkpoint state <-> one safetensors file (--ckpt-format safetensors).

Tensors (and numpy arrays) are stored as safetensors entries named by their path; the
structure around them (dicts, lists, tuples, numbers, strings) goes into the header's
metadata as JSON, so loading never unpickles anything.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Callable, Dict

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


_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
           torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16",
           torch.uint32: "U32", torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3",
           torch.float8_e5m2: "F8_E5M2"}


def write_state(state: Dict[str, Any], write: Callable[[Any], Any]) -> None:
    """A nested state (tensors anywhere inside) as a safetensors file, handed to `write`
    piece by piece: the header, then each tensor's bytes where they lie (an offloaded
    optimizer's host shards are not copied, nor is the file built in memory)."""
    tensors: Dict[str, torch.Tensor] = {}
    structure = _encode(state, "s", tensors)
    header: Dict[str, Any] = {"__metadata__": {_KEY: json.dumps(structure)}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"safetensors checkpoint cannot store {tensor.dtype} at {name!r}: "
                             f"use --ckpt-format torch")
        end = offset + tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header with spaces to 8 bytes
    write(struct.pack("<Q", len(raw)))
    write(raw)
    for tensor in tensors.values():
        if tensor.numel():
            write(tensor.reshape(-1).view(torch.uint8).numpy().data)


def save_state(state: Dict[str, Any], path: str) -> None:
    """Write a nested state (tensors anywhere inside) to a safetensors file."""
    with open(path, "wb") as f:
        write_state(state, f.write)


def load_state(path: str) -> Dict[str, Any]:
    """Read a file written by `save_state`."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        structure = json.loads(f.metadata()[_KEY])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return _decode(structure, tensors)
