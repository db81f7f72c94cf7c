"""The largest token id of a `.bin`, checked against the vocabulary when a dataset is opened.

Ids at or past the vocabulary fail deep inside the embedding at tp=1 and, worse, are
silently read as zero rows at tp>1 (each vocab shard masks ids outside its range). One scan
of the data file finds the largest id; it is cached next to the sample indices (keyed by
the file's size and modification time), and skipped when the file's token dtype cannot hold
an id as large as the vocabulary.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import numpy as np

from gigatron.data.index_cache import cached_indices
from gigatron.parallel.comm import Group

if TYPE_CHECKING:
    from gigatron.data.indexed_dataset import IndexedDataset

CHUNK_TOKENS = 1 << 26


def scan_max_token(data: np.ndarray) -> int:
    """Largest value of a (memory-mapped) token array, read in bounded chunks."""
    best = -1
    for start in range(0, len(data), CHUNK_TOKENS):
        best = max(best, int(np.max(data[start:start + CHUNK_TOKENS])))
    return best


def max_token_id(indexed: "IndexedDataset", cache_dir: Optional[str], group: Group = None) -> int:
    """Largest token id in an IndexedDataset's data file (cached when `cache_dir` is set)."""
    lengths, pointers = indexed.sequence_lengths, indexed.sequence_pointers
    if len(lengths) == 0:
        return -1
    end = int(pointers[-1]) // indexed.itemsize + int(lengths[-1])
    tokens = np.frombuffer(indexed._data, indexed.dtype, end)
    stat = os.stat(indexed.bin_path)
    description = {"class": "TokenRange", "bin": os.path.abspath(indexed.bin_path),
                   "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    prefix = os.path.basename(str(indexed.path_prefix)) + "_tokens"
    arrays = cached_indices(("max_token_id",), lambda: {"max_token_id": np.array(
        [scan_max_token(tokens)], dtype=np.int64)}, description, cache_dir, prefix, group)
    return int(arrays["max_token_id"][0])


def check_token_range(indexed: "IndexedDataset", vocab_size: Optional[int], cache_dir: Optional[str],
                      group: Group = None) -> None:
    """Refuse a data file holding ids outside a `vocab_size` vocabulary (None: unchecked)."""
    if vocab_size is None or not hasattr(indexed, "bin_path"):
        return
    if np.issubdtype(indexed.dtype, np.integer) and np.iinfo(indexed.dtype).max < vocab_size:
        return  # the dtype cannot hold an id past the vocabulary
    largest = max_token_id(indexed, cache_dir, group)
    if largest >= vocab_size:
        raise ValueError(
            f"{indexed.bin_path} holds token id {largest}, outside this run's vocabulary of "
            f"{vocab_size} ids: it was tokenized with another tokenizer. Give the tokenizer it "
            f"was made with (--tokenizer-type, --vocab-file/--merge-file, --tokenizer-model, "
            f"--vocab-size), or re-run tools/preprocess_data.py with this one")
