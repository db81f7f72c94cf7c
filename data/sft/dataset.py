"""SFT samples of a conversations file's split, and the train/valid/test datasets of
`--sft` (Megatron-LM's meaning: --data-path names JSON-lines files, --split divides each
file's lines, a line is one sample, the samples go through the split's lines in order and
start over when more are asked for).

The lines of a split are tokenized once when the dataset is built, so that what the sequence
length cuts is known (and printed once) before training starts.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from gigatron.data.sft.chat_template import ChatTemplateTokenizer
from gigatron.data.sft.conversations import Conversation
from gigatron.data.sft.packing import PackStats, Tokenized, pack_conversations


class SFTDataset:
    """Samples {tokens, labels, loss_mask, position_ids, cu_seqlens} of one file's lines."""

    def __init__(self, tokenized: Sequence[Sequence[Tokenized]], num_samples: int,
                 seq_length: int, eod: int, pad: int, source: str = "",
                 name: str = "train", pad_multiple: int = 1) -> None:
        if not tokenized:
            raise ValueError(f"the {name} split of {source} has no conversations; adjust "
                             f"--split")
        self.lines, self.num_samples = list(tokenized), int(num_samples)
        self.seq_length, self.eod, self.pad = seq_length, eod, pad
        self.source, self.name = source, name
        self.pad_multiple = pad_multiple  # 2 x cp under context parallelism (packing.py)
        self.stats = PackStats()
        self.note: str = ""  # said once in the run's data summary (the assistant-token rule)
        self.tokens_per_epoch = 0
        for line in self.lines:
            _, stats = pack_conversations(line, seq_length, eod, pad, pad_multiple)
            self.stats.truncated += stats.truncated
            self.stats.dropped += stats.dropped
            self.tokens_per_epoch += sum(len(ids) for ids, _ in line)
        self.num_conversations = sum(len(line) for line in self.lines)
        self.num_documents = len(self.lines)  # lines, for the run's data summary

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range for {self.num_samples} {self.name} "
                             f"samples")
        line = self.lines[idx % len(self.lines)]
        return pack_conversations(line, self.seq_length, self.eod, self.pad,
                                  self.pad_multiple)[0]

    def describe(self) -> str:
        """' from N lines, C conversations, T tokens of FILE' and what the sequence length
        cuts (for the run's data summary)."""
        cut = ""
        if self.stats.truncated or self.stats.dropped:
            cut = (f"; --seq-length {self.seq_length} truncates {self.stats.truncated} and "
                   f"drops {self.stats.dropped} conversation(s) of these lines (a line's "
                   f"conversations that do not fit are cut, as Megatron-LM's --sft does)")
        return (f" from {len(self.lines):,} lines, {self.num_conversations:,} conversations, "
                f"{self.tokens_per_epoch:,} tokens of {self.source}{cut}")


def tokenize_lines(lines: Sequence[Sequence[Conversation]], chat: ChatTemplateTokenizer, path: str,
                   first_line: int = 0) -> List[List[Tokenized]]:
    """Each line's conversations as (ids, assistant mask); a template failure names the
    line."""
    out = []
    for i, line in enumerate(lines):
        try:
            out.append([chat.tokenize(conversation) for conversation in line])
        except ValueError as err:
            raise ValueError(f"{path}: conversation line {first_line + i + 1}: {err}") from None
    return out
