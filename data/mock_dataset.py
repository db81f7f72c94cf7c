"""--mock-data: Megatron-Core's mock documents, and GPT samples over them computed per index.

The documents are those of Megatron-Core's `MockGPTLowLevelDataset`: 100,000 of them, the
lengths drawn once by `numpy.random.default_rng(0).integers(1, 4096, 100000)`, document d
being the tokens 1, 2, ..., length - 1 (modulo the vocabulary) followed by eod. So Megatron's
own splits and eval settings (`--split 99990,8,2 --eval-iters 10`) find the same documents.

Those are ~200M tokens per epoch: `GPTDataset` would lay out an index over every sample of
the epoch (millions at a short --seq-length). `MockGPTDataset` instead computes sample i from
i alone: the same stream as `GPTDataset` (each epoch's documents shuffled by (seed, epoch),
sample j starting at token j * seq_length), with the samples of each epoch put in a keyed
pseudo-random order (a Feistel permutation) instead of a sorted one.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from gigatron.data.documents import gpt_sample
from gigatron.data.sample_index import (DOC_SALT, SAMPLE_SALT, num_epochs_needed,
                                        samples_in_epochs)

_MASK64 = (1 << 64) - 1
_CACHED_EPOCHS = 4


class MockIndexedDataset:
    """Megatron-Core's MockGPTLowLevelDataset with the indexed-dataset interface."""

    seed = 0  # Megatron-Core's: the documents do not depend on --seed
    size = 100_000
    max_sequence_length = 4096

    def __init__(self, vocab_size: int, eod: int) -> None:
        if not 0 <= eod < vocab_size:
            raise ValueError(f"mock data: eod {eod} outside the vocabulary of {vocab_size}")
        self.vocab_size, self.eod = vocab_size, eod
        self.path_prefix = "--mock-data"
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(low=1, high=self.max_sequence_length,
                                             size=self.size, dtype=np.int32)
        self.dtype = np.dtype(np.int64)

    def __len__(self) -> int:
        return self.size

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        size = int(self.sequence_lengths[idx])
        length = size - offset if length is None else length
        tokens = np.arange(offset + 1, offset + length + 1, dtype=np.int64) % self.vocab_size
        if offset + length == size:  # the last token of a document is eod
            tokens[-1] = self.eod
        return tokens


def _mix(value: int, key: int) -> int:
    """splitmix64's finaliser of value + key: the round function of the permutation."""
    x = (value + key * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def keyed_permutation(k: int, n: int, key: int) -> int:
    """Where k goes in a pseudo-random permutation of range(n) chosen by `key`, in O(1):
    a 4-round Feistel network on the smallest square power of two >= n, walking the cycle
    until it lands back in range (fewer than 4 steps on average)."""
    half = (max(n - 1, 1).bit_length() + 1) // 2
    mask = (1 << half) - 1
    while True:
        left, right = k >> half, k & mask
        for round_key in range(key, key + 4):
            left, right = right, left ^ (_mix(right, round_key) & mask)
        k = (left << half) | right
        if k < n:
            return k


class MockGPTDataset:
    """GPTDataset's samples (same fields, same stream of documents) over the mock documents,
    each computed from its index: no index arrays, whatever the number of epochs."""

    def __init__(self, indexed_dataset: MockIndexedDataset, documents: np.ndarray,
                 num_samples: int, seq_length: int, seed: int, eod: Optional[int] = None,
                 eod_mask_loss: bool = False, name: str = "train",
                 reset_position_ids: bool = False, reset_attention_mask: bool = False) -> None:
        if eod_mask_loss and eod is None:
            raise ValueError("--eod-mask-loss needs the tokenizer's eod id")
        self.documents = np.asarray(documents, dtype=np.int64)
        if len(self.documents) == 0:
            raise ValueError(f"{name} split of {indexed_dataset.path_prefix} has no "
                             f"documents; adjust --split")
        self.indexed_dataset, self.seq_length, self.seed, self.name = (
            indexed_dataset, seq_length, seed, name)
        self.eod, self.eod_mask_loss = eod, eod_mask_loss
        self.resets = (reset_position_ids, reset_attention_mask)  # data/documents.py
        self.sizes = np.asarray(indexed_dataset.sequence_lengths[self.documents], np.int64)
        self.tokens_per_epoch = int(self.sizes.sum())
        self.num_epochs = num_epochs_needed(num_samples, self.tokens_per_epoch, seq_length)
        self.source, self.num_documents = str(indexed_dataset.path_prefix), len(self.documents)
        self._length = samples_in_epochs(self.num_epochs, self.tokens_per_epoch, seq_length)
        self._epochs: Dict[int, Tuple[np.ndarray, np.ndarray, int]] = {}

    def __len__(self) -> int:
        return self._length

    def _epoch(self, epoch: int) -> Tuple[np.ndarray, np.ndarray, int]:
        """(positions of this split's documents in the epoch's order, their end offsets,
        the key of the epoch's sample order)."""
        if epoch not in self._epochs:
            if len(self._epochs) >= _CACHED_EPOCHS:
                self._epochs.pop(next(iter(self._epochs)))
            order = np.random.default_rng([self.seed, DOC_SALT, epoch]).permutation(
                len(self.documents))
            key = int(np.random.default_rng([self.seed, SAMPLE_SALT, epoch]).integers(1 << 62))
            self._epochs[epoch] = order, np.cumsum(self.sizes[order]), key
        return self._epochs[epoch]

    def _stream(self, position: int, count: int) -> np.ndarray:
        """`count` tokens of the split's stream from `position` (epochs laid end to end)."""
        epoch, offset = divmod(position, self.tokens_per_epoch)
        order, ends, _ = self._epoch(epoch)
        k = int(np.searchsorted(ends, offset, side="right"))
        offset -= int(ends[k] - self.sizes[order[k]])
        parts = []
        while count > 0:
            size = int(self.sizes[order[k]])
            take = min(count, size - offset)
            parts.append(self.indexed_dataset.get(int(self.documents[order[k]]), offset, take))
            count, offset, k = count - take, 0, k + 1
            if k == len(order) and count > 0:
                epoch, k = epoch + 1, 0
                order, ends, _ = self._epoch(epoch)
        return np.concatenate(parts)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The `seq_length + 1` tokens of (shuffled) sample `idx`, as int64."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} {self.name} samples")
        idx = int(idx)
        epoch = idx * self.seq_length // self.tokens_per_epoch  # samples start in epochs
        first = samples_in_epochs(epoch, self.tokens_per_epoch, self.seq_length)
        end = samples_in_epochs(epoch + 1, self.tokens_per_epoch, self.seq_length)
        start = first + keyed_permutation(idx - first, end - first, self._epoch(epoch)[2])
        return self._stream(start * self.seq_length, self.seq_length + 1)

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        return gpt_sample(self.sample_tokens(idx), self.eod, self.eod_mask_loss, *self.resets)
