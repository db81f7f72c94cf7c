"""The files a checkpoint's recorded flags name: absolute paths, and a copy of the tokenizer.

metadata.json records the flags of the run that saved, and `gigatron generate` / `evaluate`
rebuild the tokenizer and the data from them. A relative path there means nothing from
another folder, so `recorded_flags` makes the tokenizer files, the data prefixes and the
cache folder absolute, and a save stores the tokenizer's own files (when together under
MAX_TOKENIZER_BYTES: a SentencePiece or TikToken model, GPT-2's vocab and merges, a BERT
vocab, a Hugging Face tokenizer.json with its configs) in the iteration folder:

    SAVE/iter_0000010/tokenizer/tokenizer_model/spm.model
    SAVE/iter_0000010/tokenizer/vocab_file/vocab.json    SAVE/.../merge_file/merges.txt
    metadata.json  "tokenizer_files": {"tokenizer_model": {"source": "/abs/spm.model",
                   "stored": "tokenizer/tokenizer_model/spm.model", "files": {...}}}

A command that loads the checkpoint prefers the stored copy (`stored_tokenizer_flags`); a
recorded path that is gone is one line naming the checkpoint, the path and the flag that
overrides it (`missing_recorded_paths`).
"""
from __future__ import annotations

import os
import shutil
from typing import Any, Collection, Dict, List, Mapping, Optional

TOKENIZER_FILES = ("tokenizer_model", "vocab_file", "merge_file")
DATA_PREFIXES = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
FOLDERS = ("data_cache_path",)
MAX_TOKENIZER_BYTES = 50 * 2 ** 20  # a tokenizer's files are a few MB; more is not one
STORED = "tokenizer"  # the copy's folder inside the iteration folder
KEY = "tokenizer_files"  # metadata.json's record of the copy
# what a Hugging Face tokenizer folder (or a tokenizer.json beside them) needs
HF_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "chat_template.jinja")  # --sft's template (transformers 5 saves it apart)


def _prefixes(values: List[str]) -> List[str]:
    """The prefixes of a data flag's values (several: weight prefix pairs)."""
    return values[1::2] if len(values) > 1 else list(values)


def recorded_flags(flags: Mapping[str, Any]) -> Dict[str, Any]:
    """`flags` with every file, folder and data prefix as an absolute path (weights kept)."""
    out = dict(flags)
    for dest in TOKENIZER_FILES + FOLDERS:
        if isinstance(out.get(dest), str) and out[dest]:
            out[dest] = os.path.abspath(out[dest])
    for dest in DATA_PREFIXES:
        values = out.get(dest)
        if values:
            prefixes = set(range(1, len(values), 2)) if len(values) > 1 else {0}
            out[dest] = [os.path.abspath(v) if i in prefixes else v
                         for i, v in enumerate(values)]
    return out


def _tokenizer_entry(dest: str, path: str) -> Optional[Dict[str, Any]]:
    """What to store of one tokenizer flag's file or folder (None: nothing there)."""
    if os.path.isdir(path):
        files = {n: os.path.join(path, n) for n in HF_FILES
                 if os.path.isfile(os.path.join(path, n))}
        stored = f"{STORED}/{dest}"
    elif os.path.isfile(path):
        name = os.path.basename(path)
        files = {name: path}
        if name == "tokenizer.json":  # its configs name the end-of-document token
            folder = os.path.dirname(path)
            files.update({n: os.path.join(folder, n) for n in HF_FILES
                          if os.path.isfile(os.path.join(folder, n))})
        stored = f"{STORED}/{dest}/{name}"
    else:
        return None
    return {"source": path, "stored": stored, "files": files} if files else None


def tokenizer_record(flags: Mapping[str, Any],
                     limit: int = MAX_TOKENIZER_BYTES) -> Dict[str, Any]:
    """metadata.json's KEY entry for the tokenizer files `flags` (absolute) name, or {}
    when there are none or they are together `limit` bytes or more."""
    entries = {}
    for dest in TOKENIZER_FILES:
        path = flags.get(dest)
        entry = _tokenizer_entry(dest, path) if isinstance(path, str) and path else None
        if entry is not None:
            entries[dest] = entry
    try:
        size = sum(os.path.getsize(f) for e in entries.values() for f in e["files"].values())
    except OSError:
        return {}
    return {KEY: entries} if entries and size < limit else {}


def store_tokenizer(folder: str, metadata: Dict[str, Any]) -> Dict[str, Any]:
    """Copy the tokenizer files metadata's KEY entry names into `folder` (an iteration
    folder being published); returns the metadata without the ones that could not be
    copied (a file removed since the run started): the save does not fail for them."""
    entries = metadata.get(KEY)
    if not isinstance(entries, dict):
        return metadata
    kept = {}
    for dest, entry in entries.items():
        target = os.path.join(folder, STORED, dest)
        try:
            os.makedirs(target, exist_ok=True)
            for name, source in entry["files"].items():
                shutil.copyfile(source, os.path.join(target, name))
        except OSError:
            shutil.rmtree(target, ignore_errors=True)
            continue
        kept[dest] = entry
    out = {k: v for k, v in metadata.items() if k != KEY}
    if kept:
        out[KEY] = kept
    return out


def stored_tokenizer_flags(folder: str, metadata: Mapping[str, Any]) -> Dict[str, str]:
    """The tokenizer flags (dest -> path) of the copies stored in the iteration `folder`."""
    entries = metadata.get(KEY)
    out = {}
    for dest, entry in (entries.items() if isinstance(entries, dict) else ()):
        path = os.path.join(folder, entry.get("stored", ""))
        if dest in TOKENIZER_FILES and os.path.exists(path):
            out[dest] = os.path.abspath(path)
    return out


def missing_recorded_paths(flags: Mapping[str, Any], given: Collection[str],
                           folder: str) -> List[str]:
    """One line per tokenizer file or data prefix the checkpoint in `folder` recorded in
    `flags` (those not `given` on the command line) that does not exist: the override."""
    from gigatron.data.tokenizer import TOKENIZER_NEEDS, tokenizer_type_to_build
    from gigatron.training.config.table import flag_name

    lines = []
    # another --tokenizer-type given: its own files are checked when it is built
    tokenizer_type = None if "tokenizer_type" in given else tokenizer_type_to_build(flags)
    needs = TOKENIZER_NEEDS.get(tokenizer_type or "", ())
    for dest in (d for d in TOKENIZER_FILES if d in needs and d not in given):
        path = flags.get(dest)
        if isinstance(path, str) and path and not os.path.exists(path):
            lines.append(f"checkpoint {folder} records {flag_name(dest)} {path}, which does not "
                         f"exist{_relative(path)}, and holds no copy of it: give "
                         f"{flag_name(dest)} PATH")
    if flags.get("mock_data"):
        return lines
    for dest in (d for d in DATA_PREFIXES if d not in given):
        for prefix in _prefixes(list(flags.get(dest) or [])):
            # --sft's data are the conversation files themselves
            gone = ([prefix] if not os.path.isfile(prefix) else []) if flags.get("sft") else \
                [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if gone:
                lines.append(f"checkpoint {folder} records {flag_name(dest)} prefix {prefix}, but "
                             f"{gone[0]} does not exist{_relative(prefix)}: give --data-path "
                             f"PREFIX (or --train-data-path ...; a data flag replaces the "
                             f"checkpoint's data)")
    return lines


def _relative(path: str) -> str:
    return "" if os.path.isabs(path) else \
        " (relative to the folder the training ran in, not this one)"
