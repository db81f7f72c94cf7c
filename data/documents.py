"""Documents inside one sample: the batch format of their boundaries (DESIGN decision 16).

A packed sample holds several documents back to back. Where they start and end travels with
the micro-batch as boundaries, never as a dense sequence x sequence mask:

  cu_seqlens  int32 [s + 1] per sample ([b, s + 1] once collated): the cumulative document
              lengths over the sample's s input positions, starting at 0 and reaching s,
              padded at the end by repeating s (so every sample of any document count has
              the same shape; a repeated value is an empty document, which attention
              ignores). Document j holds input positions cu_seqlens[j] .. cu_seqlens[j+1]-1.
              Present only when attention stays inside documents (--reset-attention-mask,
              or SFT conversations); without it a sample is one causal stream. It stays a
              host (CPU) tensor: attention plans its per-document blocks from it without
              reading the device. Under context parallelism every cp rank holds the whole
              sample's boundaries (global positions), never split.
  position_ids  int64 [s]: positions restart at 0 after each boundary with
              --reset-position-ids (Megatron's meaning: only then).
  loss_mask   float32 [s]: 0 where the input is the eod token with --eod-mask-loss; SFT puts
              0 on the prompt's tokens.

Megatron's meaning (megatron.core.datasets.gpt_dataset.get_ltor_masks_and_position_ids): a
document ends at its end-of-document token, which still belongs to it; the next one starts
right after. Producers other than the pretraining samples (SFT's packed conversations) build
the same keys: `cu_seqlens_from_lengths` pads a list of document lengths to the format.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Union

import numpy as np

CU_SEQLENS = "cu_seqlens"


def cu_seqlens_from_lengths(lengths: Union[Sequence[int], np.ndarray],
                            seq_length: int) -> np.ndarray:
    """The padded `cu_seqlens` [seq_length + 1] of documents of these lengths, laid from
    position 0 (lengths summing to less than seq_length leave a last document of the rest,
    e.g. padding, which then attends only to itself)."""
    ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
    if len(ends) and ends[-1] > seq_length:
        raise ValueError(f"documents of {int(ends[-1])} tokens do not fit a sample of "
                         f"{seq_length}")
    out = np.full(seq_length + 1, seq_length, dtype=np.int32)
    out[0] = 0
    out[1:1 + len(ends)] = ends
    return out


def eod_boundaries(inputs: np.ndarray, eod: int) -> np.ndarray:
    """The padded `cu_seqlens` of a sample's inputs: a document ends after each eod."""
    ends = np.flatnonzero(inputs == eod) + 1
    ends = ends[ends < len(inputs)]  # an eod at the last position ends the sample anyway
    lengths = np.diff(np.concatenate([[0], ends, [len(inputs)]]))
    return cu_seqlens_from_lengths(lengths, len(inputs))


def reset_positions(cu_seqlens: np.ndarray) -> np.ndarray:
    """Positions [s] that restart at 0 at every document start."""
    s = int(cu_seqlens[-1])
    starts = np.zeros(s, dtype=np.int64)
    first = cu_seqlens[:-1][cu_seqlens[:-1] < s].astype(np.int64)
    starts[first] = first  # later duplicates (empty documents) write the same value
    return np.arange(s, dtype=np.int64) - np.maximum.accumulate(starts)


def gpt_sample(tokens: np.ndarray, eod: Optional[int], eod_mask_loss: bool = False,
               reset_position_ids: bool = False, reset_attention_mask: bool = False
               ) -> Dict[str, np.ndarray]:
    """Inputs, next-token labels, loss mask (0 on eod inputs if asked), positions (restarting
    after each eod if asked) and, with `reset_attention_mask`, the documents' `cu_seqlens`."""
    inputs, labels = tokens[:-1], tokens[1:]
    loss_mask = np.ones(len(inputs), dtype=np.float32)
    if eod_mask_loss:
        loss_mask[inputs == eod] = 0.0
    sample = {"tokens": inputs, "labels": labels, "loss_mask": loss_mask,
              "position_ids": np.arange(len(inputs), dtype=np.int64)}
    if reset_position_ids or reset_attention_mask:
        if eod is None:
            raise ValueError("--reset-position-ids / --reset-attention-mask need the "
                             "tokenizer's eod id")
        cu_seqlens = eod_boundaries(inputs, eod)
        if reset_position_ids:
            sample["position_ids"] = reset_positions(cu_seqlens)
        if reset_attention_mask:
            sample[CU_SEQLENS] = cu_seqlens
    return sample
