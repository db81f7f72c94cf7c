"""Pure, vectorised construction of GPT sample indices (no compiled helper).

The token stream of a split is its documents, shuffled per epoch, laid end to end for as many
epochs as needed. Sample j is the `seq_length + 1` tokens starting at stream position
`j * seq_length`, so consecutive samples share exactly one token (the last label of one is the
first input of the next) and no token is skipped.

Everything is *prefix-stable*: epoch e's document order and the order of the samples that
start in epoch e depend only on (seed, e) and the document sizes, so asking for more samples
(a longer run) extends the sample sequence without changing its beginning.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

DOC_SALT, SAMPLE_SALT = 0x646F63, 0x736D70  # separate random streams for documents / samples
FEW_DOCUMENTS = 1 << 16


def samples_in_epochs(num_epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Samples whose first token lies in the first `num_epochs` epochs."""
    return -(-num_epochs * tokens_per_epoch // seq_length)


def num_epochs_needed(num_samples: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Fewest epochs whose samples number at least `num_samples` (at least one epoch)."""
    if tokens_per_epoch <= 0:
        raise ValueError("the dataset split has no tokens; check --split and the data files")
    epochs = max(1, ((max(num_samples, 1) - 1) * seq_length) // tokens_per_epoch + 1)
    while samples_in_epochs(epochs, tokens_per_epoch, seq_length) < num_samples:
        epochs += 1  # guards the formula; never taken in practice
    return epochs


def epochs_to_build(num_epochs: int, tokens_per_epoch: int, seq_length: int) -> int:
    """Epochs of documents to lay out so the last sample of epoch `num_epochs` is complete."""
    return num_epochs + -(-seq_length // tokens_per_epoch)


def _row_permutations(rng: np.random.Generator, rows: int, n: int) -> np.ndarray:
    """`rows` independent permutations of range(n), from a prefix-stable random stream."""
    keys = rng.random(rows * n).reshape(rows, n)
    return np.argsort(keys, axis=1, kind="stable")


def build_document_index(documents: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """Document ids for `num_epochs` epochs, each epoch its own shuffle of `documents`.

    Many documents: one O(n) permutation per epoch from a generator seeded by (seed, epoch).
    Few documents (possibly very many epochs): all epochs at once from one random stream.
    Which path is taken depends only on the number of documents, never on num_epochs.
    """
    documents = np.asarray(documents, dtype=np.int64)
    n = len(documents)
    if n < FEW_DOCUMENTS:
        rng = np.random.default_rng([seed, DOC_SALT])
        order = _row_permutations(rng, num_epochs, n)
        return documents[order].reshape(-1)
    return np.concatenate([documents[np.random.default_rng([seed, DOC_SALT, e]).permutation(n)]
                           for e in range(num_epochs)])


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_samples: int) -> np.ndarray:
    """[num_samples + 1, 2] of (position in document_index, token offset) per sample start.

    Sample j spans from entry j to entry j+1 inclusive (seq_length + 1 tokens).
    """
    doc_sizes = np.asarray(sizes, dtype=np.int64)[document_index]
    ends = np.cumsum(doc_sizes)  # ends[k] = stream position just past document k
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    if num_samples and positions[-1] >= ends[-1]:
        raise ValueError(f"build_sample_index: {num_samples} samples of {seq_length} tokens "
                         f"need {positions[-1] + 1} tokens, the stream has {ends[-1]}")
    doc = np.searchsorted(ends, positions, side="right")  # skips empty documents
    starts = ends[doc] - doc_sizes[doc]
    return np.stack([doc, positions - starts], axis=1)


def build_shuffle_index(tokens_per_epoch: int, seq_length: int, num_epochs: int,
                        seed: int) -> np.ndarray:
    """Order of samples: those starting in epoch e are shuffled among themselves, epoch by epoch."""
    bounds = np.array([samples_in_epochs(e, tokens_per_epoch, seq_length)
                       for e in range(num_epochs + 1)], dtype=np.int64)
    total = int(bounds[-1])
    epoch_of = np.repeat(np.arange(num_epochs), np.diff(bounds))
    keys = np.random.default_rng([seed, SAMPLE_SALT]).random(total)
    return np.lexsort((keys, epoch_of)).astype(np.int64)


def build_gpt_indices(sizes: np.ndarray, documents: np.ndarray, seq_length: int,
                      num_samples: int, seed: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) covering at least `num_samples` samples."""
    if seq_length <= 0:
        raise ValueError(f"--seq-length {seq_length} must be positive")
    tokens_per_epoch = int(np.asarray(sizes, dtype=np.int64)[documents].sum())
    epochs = num_epochs_needed(num_samples, tokens_per_epoch, seq_length)
    document_index = build_document_index(
        documents, epochs_to_build(epochs, tokens_per_epoch, seq_length), seed)
    total = samples_in_epochs(epochs, tokens_per_epoch, seq_length)
    sample_index = build_sample_index(sizes, document_index, seq_length, total)
    shuffle_index = build_shuffle_index(tokens_per_epoch, seq_length, epochs, seed)
    return document_index, sample_index, shuffle_index
