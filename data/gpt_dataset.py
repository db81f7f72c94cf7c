"""GPT pre-training samples: `seq_length + 1` consecutive tokens across document boundaries.

Sample i of a split is a pure function of (document sizes and tokens, split range, seq_length,
seed): see `sample_index` for the construction and `index_cache` for how the indices are built
once and shared between ranks.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Dict, Optional, Protocol

import numpy as np

from gigatron.data.documents import gpt_sample
from gigatron.data.index_cache import array_digest, cached_indices
from gigatron.data.sample_index import build_gpt_indices, num_epochs_needed
from gigatron.parallel.comm import Group

if TYPE_CHECKING:
    from gigatron.data.indexed_dataset import IndexedDataset

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


def default_cache_dir(path_prefix: Optional[str]) -> Optional[str]:
    """Indices live next to the data unless --data-cache-path says otherwise."""
    if not path_prefix:
        return None
    return os.path.dirname(os.path.abspath(path_prefix))


class SampleDataset(Protocol):
    """What training reads from a split: its length and sample dicts by index
    (GPTDataset, BlendedDataset)."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]: ...


class GPTDataset:
    """Samples {tokens, labels, loss_mask, position_ids (+ cu_seqlens: data/documents.py)} from
    one indexed dataset's split.

    `indexed_dataset` is an `IndexedDataset` (or anything with `sequence_lengths`, `get` and
    `path_prefix`); `documents` are the sequence ids of this split.
    """

    def __init__(self, indexed_dataset: "IndexedDataset", documents: np.ndarray, num_samples: int,
                 seq_length: int, seed: int, eod: Optional[int] = None,
                 eod_mask_loss: bool = False, cache_dir: Optional[str] = None,
                 group: Group = None, name: str = "train",
                 reset_position_ids: bool = False, reset_attention_mask: bool = False) -> None:
        if eod_mask_loss and eod is None:
            raise ValueError("--eod-mask-loss needs the tokenizer's eod id")
        self.indexed_dataset, self.seq_length, self.name = indexed_dataset, seq_length, name
        self.eod, self.eod_mask_loss = eod, eod_mask_loss
        self.resets = (reset_position_ids, reset_attention_mask)  # data/documents.py
        documents = np.asarray(documents, dtype=np.int64)
        if len(documents) == 0:
            raise ValueError(f"{name} split of {indexed_dataset.path_prefix} has no documents; "
                             f"adjust --split")
        sizes = indexed_dataset.sequence_lengths
        tokens_per_epoch = int(np.asarray(sizes[documents], dtype=np.int64).sum())
        description = {
            "class": "GPTDataset", "split": name, "seq_length": int(seq_length),
            "seed": int(seed), "tokens_per_epoch": tokens_per_epoch,
            "num_epochs": num_epochs_needed(num_samples, tokens_per_epoch, seq_length),
            "documents": [int(documents[0]), int(documents[-1]) + 1, len(documents)],
            "sizes_md5": array_digest(sizes[documents]),
        }

        # for the run's dataset summary
        self.source, self.num_documents = str(indexed_dataset.path_prefix), len(documents)
        self.tokens_per_epoch, self.num_epochs = tokens_per_epoch, description["num_epochs"]

        def build() -> Dict[str, np.ndarray]:
            return dict(zip(INDEX_NAMES, build_gpt_indices(sizes, documents, seq_length,
                                                           num_samples, seed)))

        prefix = os.path.basename(str(indexed_dataset.path_prefix)) + f"_{name}"
        arrays = cached_indices(INDEX_NAMES, build, description, cache_dir, prefix, group)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The `seq_length + 1` tokens of (shuffled) sample `idx`, as int64."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} {self.name} samples")
        j = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, docs = self.indexed_dataset.get, self.document_index
        if d0 == d1:
            return get(int(docs[d0]), o0, o1 - o0 + 1).astype(np.int64)
        parts = [get(int(docs[d0]), o0)]
        parts += [get(int(docs[d])) for d in range(d0 + 1, d1)]
        parts.append(get(int(docs[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        return gpt_sample(self.sample_tokens(idx), self.eod, self.eod_mask_loss, *self.resets)

