"""The train/valid/test datasets of `--sft` from --data-path (or --train/valid/test-data-path)
JSON-lines files: --split divides each file's lines (Megatron-Core's rounding, data/splits.py),
several files blend by their weights (or by their lines when none are given)."""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from gigatron.data.blended_dataset import (BlendedDataset, normalise_weights, parse_data_path,
                                           samples_per_dataset)
from gigatron.data.sft.chat_template import FALLBACK_RULE, ChatTemplateTokenizer
from gigatron.data.sft.conversations import Conversation, read_conversations
from gigatron.data.sft.dataset import SFTDataset, tokenize_lines
from gigatron.data.splits import SPLIT_NAMES, parse_split, split_ranges

Lines = List[List[Conversation]]


def _split(chat: ChatTemplateTokenizer, files: Sequence[Tuple[str, Lines, Tuple[int, int]]],
           weights: Optional[List[float]], num_samples: int, seq_length: int, eod: int,
           name: str, cp: int = 1) -> Any:
    """One split over (path, lines, [start, end)) of each file."""
    pad = chat.pad if chat.pad is not None else eod
    # under cp each conversation is padded to a multiple of 2 x cp (Megatron-LM's --sft)
    multiple = 2 * cp if cp > 1 else 1

    def one(path: str, lines: Lines, span: Tuple[int, int], n: int) -> SFTDataset:
        start, end = span
        dataset = SFTDataset(tokenize_lines(lines[start:end], chat, path, start), n,
                             seq_length, eod, pad, path, name, multiple)
        dataset.note = "" if chat.has_generation_blocks else FALLBACK_RULE
        return dataset

    if len(files) == 1:
        return one(*files[0], num_samples)
    if weights is None:
        weights = normalise_weights([end - start for _, _, (start, end) in files])
    counts = samples_per_dataset(weights, num_samples)
    return BlendedDataset([one(*f, n) if n else None for f, n in zip(files, counts)],
                          weights, num_samples)


def build_sft_datasets(config: Any, wanted: Sequence[int]) -> List[Optional[Any]]:
    """[train, valid, test] SFT datasets of a GPTDataConfig with `sft` set (None for a split
    asked for no samples or given no lines)."""
    assert config.eod is not None, "the tokenizer's eod fills GPTDataConfig.eod"
    chat = ChatTemplateTokenizer(config.tokenizer_model)
    result: List[Optional[Any]] = []
    if config.data_path:
        paths, weights = parse_data_path(config.data_path)
        read = {p: read_conversations(p) for p in paths}
        fractions = parse_split(config.split)
        ranges = {p: split_ranges(fractions, len(lines)) for p, lines in read.items()}
        for s, (name, n) in enumerate(zip(SPLIT_NAMES, wanted)):
            files = [(p, read[p], ranges[p][s]) for p in paths]
            empty = all(end == start for _, _, (start, end) in files)
            if n and empty and s < len(fractions) and fractions[s] > 0:
                raise ValueError(f"the {name} split is empty: --split {config.split} gives "
                                 f"it none of the {sum(len(v) for v in read.values())} "
                                 f"conversation lines: give it a larger share")
            result.append(None if n == 0 or empty else
                          _split(chat, files, weights, n, config.seq_length, config.eod, name,
                                 config.context_parallel_size))
        return result
    for name, n, values in zip(SPLIT_NAMES, wanted, (config.train_data_path,
                                                     config.valid_data_path,
                                                     config.test_data_path)):
        if n == 0 or not values:
            result.append(None)
            continue
        paths, weights = parse_data_path(values, f"--{name}-data-path")
        files = []
        for p in paths:
            lines = read_conversations(p)
            files.append((p, lines, (0, len(lines))))
        result.append(_split(chat, files, weights, n, config.seq_length, config.eod, name,
                             config.context_parallel_size))
    return result
