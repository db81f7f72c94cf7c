"""Where a DeepSpeed config comes from: the one loader of pretrain_gpt.py's --deepspeed-config
and `gigatron.initialize`'s config (a dict, a JSON file, or DeepSpeed's base64 text). What
cannot be read is a ConfigError of one line naming the file (and, for bad JSON, the line and
column), never the JSON parser's traceback."""
from __future__ import annotations

import base64
import binascii
import copy
import json
import os
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple, Union

from gigatron.training.config.validation import ConfigError

ConfigSource = Union[str, "os.PathLike[str]", Mapping]


def _no_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    keys = [k for k, _ in pairs]
    twice = sorted({k for k in keys if keys.count(k) > 1})
    if twice:  # DeepSpeed refuses these too
        raise ValueError(f"key {twice[0]!r} appears twice in one object: keep one")
    return dict(pairs)


def _base64_json(text: str) -> Optional[Dict[str, Any]]:
    """DeepSpeed also takes the config as url-safe base64 of the JSON text."""
    if not re.fullmatch(r"[A-Za-z0-9_-]{8,}={0,2}", text):
        return None
    try:
        ds = json.loads(base64.urlsafe_b64decode(text).decode("utf-8"))
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return ds if isinstance(ds, dict) else None


def load_config(config: ConfigSource, name: str = "DeepSpeed config") -> Dict[str, Any]:
    """The config as a fresh dict: a Mapping (copied), a JSON file or DeepSpeed's base64 text;
    a ConfigError of one line naming it (`name`: the flag or argument that gave it), the file
    and, for bad JSON, the position."""
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError([f"{name} must be a path to a DeepSpeed JSON file or a dict, got "
                           f"{type(config).__name__}"])
    path = os.fspath(config)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as err:
        decoded = _base64_json(str(path))
        if decoded is not None:
            return decoded
        raise ConfigError([f"{name} {path}: cannot read it ({err.strerror})"]) from None
    try:
        ds = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise ConfigError([f"{name} {path} is not valid JSON: {err.msg} at line {err.lineno} "
                           f"column {err.colno}"]) from None
    except ValueError as err:
        raise ConfigError([f"{name} {path}: {err}"]) from None
    if not isinstance(ds, dict):
        raise ConfigError([f"{name} {path} must hold a JSON object {{...}}, got a "
                           f"{type(ds).__name__}"])
    return ds
