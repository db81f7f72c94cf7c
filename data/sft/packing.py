"""A line's conversations packed into one SFT sample, in the batch format of
data/documents.py (Megatron-LM's SFTDataset packing, with gigatron's assistant masks).

Each conversation is a document: its tokens (the end-of-document id appended unless the
template already ends with it), positions restarting at 0, attention inside it (cu_seqlens).
Conversations are laid back to back from position 0; the rest of the `seq_length + 1` tokens
is padding, a last document with no loss. The loss is on position t when the token at t + 1
is an assistant token of the same conversation: the last position of a conversation (whose
label is the next conversation's first token, or padding) has none, and neither has the
appended end-of-document id (it is not the template's).

Under context parallelism (`pad_multiple` 2 x cp) each conversation, its end-of-document id
included, is padded with the pad id to a multiple of 2 x cp, without loss, as Megatron-LM's
--sft does: every document then splits per document over the cp ranks
(parallel/context/split.py).

A conversation that does not fit the room left is cut there (`truncated`) and the line's
later conversations are left out (`dropped`), as Megatron-LM does; the dataset counts them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from gigatron.data.documents import CU_SEQLENS, cu_seqlens_from_lengths, reset_positions

Tokenized = Tuple[np.ndarray, np.ndarray]  # (ids int64 [n], assistant bool [n])


@dataclass
class PackStats:
    """How many conversations a line lost to the sequence length."""

    truncated: int = 0
    dropped: int = 0


def with_eod(ids: np.ndarray, assistant: np.ndarray, eod: int) -> Tokenized:
    """The conversation ending at the end-of-document id (appended, without loss, unless
    the template ends with it)."""
    if len(ids) and int(ids[-1]) == eod:
        return ids, assistant
    return np.append(ids, np.int64(eod)), np.append(assistant, False)


def padded_to(ids: np.ndarray, assistant: np.ndarray, pad: int, multiple: int) -> Tokenized:
    """The conversation padded with `pad` (no loss) to a multiple of `multiple` tokens."""
    extra = -len(ids) % multiple
    return (np.append(ids, np.full(extra, pad, dtype=np.int64)),
            np.append(assistant, np.zeros(extra, dtype=bool)))


def pack_conversations(conversations: Sequence[Tokenized], seq_length: int, eod: int,
                       pad: int, pad_multiple: int = 1
                       ) -> Tuple[Dict[str, np.ndarray], PackStats]:
    """{tokens, labels, loss_mask, position_ids, cu_seqlens} of one sample and what did not
    fit (`pad_multiple`: each conversation padded to a multiple of it)."""
    stream = np.full(seq_length + 1, pad, dtype=np.int64)
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    lengths: List[int] = []
    stats = PackStats()
    at = 0
    for k, (ids, assistant) in enumerate(conversations):
        ids, assistant = with_eod(ids, assistant, eod)
        real = len(ids)  # cutting only the padding truncates nothing
        ids, assistant = padded_to(ids, assistant, pad, pad_multiple)
        room = seq_length - at
        if room <= 0:
            stats.dropped += len(conversations) - k
            break
        n = min(len(ids), room)
        stream[at:at + n] = ids[:n]
        loss_mask[at:at + n - 1] = assistant[1:n]  # the conversation's last position: none
        lengths.append(n)
        at += n
        if n < len(ids):
            stats.truncated += int(n < real)
            stats.dropped += len(conversations) - k - 1
            break
    cu_seqlens = cu_seqlens_from_lengths(lengths, seq_length)
    sample: Dict[str, np.ndarray] = {
        "tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask,
        "position_ids": reset_positions(cu_seqlens), CU_SEQLENS: cu_seqlens}
    return sample, stats
