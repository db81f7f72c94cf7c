"""Model zoo: one small JSON file per named model, read with the standard library.

    load_config("llama3-8b", seq_length=2048)   # a TransformerConfig, overrides applied
    list_models()                               # ['debug-gpt2', ..., 'llama3-8b', ...]

Each file holds TransformerConfig fields plus optional "description" and "source" keys
(documentation only). To add a model, drop a `<name>.json` file here.
"""
from __future__ import annotations

import functools
import json
from dataclasses import fields
from pathlib import Path
from typing import Any, Dict, List, Tuple

from gigatron.models.config import TransformerConfig

ZOO_DIR = Path(__file__).resolve().parent
_DOC_KEYS = ("description", "source", "parameters")


def list_models() -> List[str]:
    """Names of all zoo models, sorted."""
    return list(_names(ZOO_DIR.stat().st_mtime_ns))


@functools.lru_cache(maxsize=4)
def _names(_modified: int) -> Tuple[str, ...]:
    """The zoo's names, read again when the folder changes (`gigatron plan --search`
    validates each of thousands of layouts against the zoo)."""
    return tuple(sorted(p.stem for p in ZOO_DIR.glob("*.json")))


def model_fields(name: str) -> Dict[str, Any]:
    """The raw config fields of zoo model `name` (without the documentation keys)."""
    path = ZOO_DIR / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(list_models())}")
    return json.loads(_text(path, path.stat().st_mtime_ns))


@functools.lru_cache(maxsize=64)
def _text(path: Path, _modified: int) -> str:
    """A zoo file's config fields as JSON text (a fresh copy for each reader), read again
    when the file changes."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return json.dumps({k: v for k, v in data.items() if k not in _DOC_KEYS})


def load_config(name: str, **overrides: Any) -> TransformerConfig:
    """The TransformerConfig of zoo model `name`, with `overrides` replacing its fields."""
    known = {f.name for f in fields(TransformerConfig)}
    values = model_fields(name)
    for source, keys in ((f"zoo file {name}.json", values), ("override", overrides)):
        unknown = sorted(set(keys) - known)
        if unknown:
            raise ValueError(f"{source} has unknown TransformerConfig field(s) {unknown}")
    values.update(overrides)
    return TransformerConfig(**values)
