"""From data flags to train/valid/test datasets: splits, per-split paths, blending, mock data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple, Union

import numpy as np

from gigatron.data.blended_dataset import (BlendedDataset, normalise_weights,
                                               parse_data_path, samples_per_dataset)
from gigatron.data.gpt_dataset import GPTDataset, SampleDataset, default_cache_dir
from gigatron.data.indexed_dataset import IndexedDataset
from gigatron.data.mock_dataset import MockGPTDataset, MockIndexedDataset
from gigatron.data.splits import SPLIT_NAMES, parse_split, split_ranges
from gigatron.data.token_range import check_token_range
from gigatron.parallel.comm import Group


@dataclass
class GPTDataConfig:
    """Everything the sample sequence depends on (field names as Megatron's flags)."""

    seq_length: int
    seed: int = 1234
    data_path: Optional[List[str]] = None  # "--data-path 0.3 a 0.7 b" or "--data-path a"
    split: str = "969,30,1"
    train_data_path: Optional[List[str]] = None
    valid_data_path: Optional[List[str]] = None
    test_data_path: Optional[List[str]] = None
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False  # data/documents.py
    reset_attention_mask: bool = False
    eod: Optional[int] = None  # tokenizer.eod
    vocab_size: Optional[int] = None  # tokenizer.vocab_size; mock data draws tokens below it
    sft: bool = False  # --sft: the paths are conversations (JSON lines; data/sft/)
    tokenizer_model: Optional[str] = None  # --sft: the tokenizer folder with a chat template
    context_parallel_size: int = 1  # --sft pads each conversation to a multiple of 2 x it

    def validate(self) -> None:
        if self.seq_length is None or self.seq_length <= 0:
            raise ValueError(f"--seq-length {self.seq_length} must be positive")
        per_split = any([self.train_data_path, self.valid_data_path, self.test_data_path])
        if per_split and self.data_path:
            raise ValueError("--data-path and --train/valid/test-data-path are exclusive: "
                             "give one or the other")
        if not (self.mock_data or per_split or self.data_path):
            raise ValueError("no data: give --data-path, --train-data-path (and optionally "
                             "--valid/--test-data-path) or --mock-data")
        if self.sft and self.mock_data:
            raise ValueError("--sft reads conversations from --data-path FILE.jsonl: "
                             "--mock-data has none")
        if self.mock_data and (self.vocab_size is None or self.eod is None):
            raise ValueError("--mock-data needs the tokenizer's vocab_size and eod")


def _gpt(config: GPTDataConfig, indexed, documents, num_samples: int, name: str, group):
    resets = (config.reset_position_ids, config.reset_attention_mask)
    if isinstance(indexed, MockIndexedDataset):  # samples computed per index, nothing cached
        return MockGPTDataset(indexed, documents, num_samples, config.seq_length, config.seed,
                              config.eod, config.eod_mask_loss, name, *resets)
    cache = config.data_cache_path or default_cache_dir(indexed.path_prefix)
    return GPTDataset(indexed, documents, num_samples, config.seq_length, config.seed,
                      config.eod, config.eod_mask_loss, cache, group, name, *resets)


def _blend(config: GPTDataConfig, sources: Sequence[Tuple[Any, np.ndarray]],
           weights: Optional[List[float]], num_samples: int, name: str, group):
    """One split over several (indexed dataset, documents) sources."""
    if len(sources) == 1:
        return _gpt(config, *sources[0], num_samples, name, group)
    if weights is None:  # no weights given: blend in proportion to the tokens of each source
        weights = normalise_weights([int(ds.sequence_lengths[docs].astype(np.int64).sum())
                                     for ds, docs in sources])
    counts = samples_per_dataset(weights, num_samples)
    datasets = [_gpt(config, ds, docs, n, name, group) if n else None
                for (ds, docs), n in zip(sources, counts)]
    return BlendedDataset(datasets, weights, num_samples)


def _open(prefixes: Sequence[str], config: GPTDataConfig, group: Group) -> List[IndexedDataset]:
    """Open each dataset and check its ids against the vocabulary (once per file)."""
    opened = [IndexedDataset(p) for p in prefixes]
    for ds in opened:
        check_token_range(ds, config.vocab_size,
                          config.data_cache_path or default_cache_dir(ds.path_prefix), group)
    return opened


def _empty_split_error(config: GPTDataConfig, name: str, indexed: Sequence[Any],
                       needed: int) -> str:
    sources = ", ".join(f"{len(ds)} in {ds.path_prefix}" for ds in indexed)
    use = "evaluation" if name != "train" else "training"
    fewest = min(len(ds) for ds in indexed)
    # a small corpus: one document each for valid and test (Megatron's rounding keeps them)
    example = f", e.g. --split {fewest - 2},1,1 (one of the {fewest} documents each for " \
              f"valid and test)" if name != "train" and fewest >= 3 else \
        " (each non-zero share needs at least one document)"
    return (f"the {name} split is empty: --split {config.split} gives it no documents "
            f"(documents: {sources}), but {use} needs {needed} {name} samples: give it a "
            f"larger share in --split{example}, more documents"
            f"{', or --eval-iters 0' if name != 'train' else ''}")


def build_train_valid_test_datasets(config: GPTDataConfig,
                                    train_valid_test_num_samples: Sequence[int],
                                    group: Group = None) -> List[Optional[SampleDataset]]:
    """[train, valid, test] datasets with at least the requested samples each (None for 0).

    Index files are built by rank 0 of `group` (ranks sharing the cache filesystem; None =
    the default group, or this process alone when torch.distributed is not initialised).
    """
    config.validate()
    wanted = [int(n) for n in train_valid_test_num_samples]
    if len(wanted) != 3:
        raise ValueError("train_valid_test_num_samples needs three numbers")
    if config.sft:
        from gigatron.data.sft.builder import build_sft_datasets

        return build_sft_datasets(config, wanted)
    if config.mock_data or config.data_path:
        indexed: List[Union[MockIndexedDataset, IndexedDataset]]
        if config.mock_data:
            assert config.vocab_size is not None and config.eod is not None  # validate() checked
            indexed, weights = [MockIndexedDataset(config.vocab_size, config.eod)], None
        else:
            prefixes, weights = parse_data_path(config.data_path or [])
            indexed = list(_open(prefixes, config, group))
        fractions = parse_split(config.split)
        fractions += [0.0] * (3 - len(fractions))
        ranges = [split_ranges(fractions, len(ds)) for ds in indexed]
        result = []
        for s, (name, n) in enumerate(zip(SPLIT_NAMES, wanted)):
            sources = [(ds, np.arange(*r[s])) for ds, r in zip(indexed, ranges)]
            empty = all(len(docs) == 0 for _, docs in sources)
            if n and empty and fractions[s] > 0:  # a share was asked for but got nothing
                raise ValueError(_empty_split_error(config, name, indexed, n))
            result.append(None if n == 0 or empty else
                          _blend(config, sources, weights, n, name, group))
        return result
    result = []
    for name, n, paths in zip(SPLIT_NAMES, wanted, (config.train_data_path,
                                                    config.valid_data_path,
                                                    config.test_data_path)):
        if n == 0 or not paths:
            result.append(None)
            continue
        prefixes, weights = parse_data_path(paths, f"--{name}-data-path")
        sources = [(ds, np.arange(len(ds))) for ds in _open(prefixes, config, group)]
        result.append(_blend(config, sources, weights, n, name, group))
    return result


def describe_datasets(datasets: Sequence[Optional[SampleDataset]]) -> List[str]:
    """The run's data, one line per split and per blended source: samples, documents,
    tokens per epoch and epochs (a split without data says so)."""
    lines = []
    for name, dataset in zip(SPLIT_NAMES, datasets):
        if dataset is None:
            lines.append(f"data {name}: none (its --split share is 0, or no samples are "
                         f"asked of it)")
        elif isinstance(dataset, BlendedDataset) and len(dataset.datasets) > 1:
            parts = dataset.datasets
            lines.append(f"data {name}: {len(dataset):,} samples blended from "
                         f"{len(parts)} sources")
            used = np.bincount(dataset.dataset_index, minlength=len(parts))
            lines += [f"  weight {w:.3f}: {n:,} samples{_source(p)}"
                      for p, w, n in zip(parts, dataset.weights, used.tolist())]
        else:
            only = dataset.datasets[0] if isinstance(dataset, BlendedDataset) else dataset
            lines.append(f"data {name}: {len(dataset):,} samples{_source(only)}")
    notes = [getattr(d, "note", "") for ds in datasets if ds is not None
             for d in (ds.datasets if isinstance(ds, BlendedDataset) else [ds]) if d is not None]
    return lines + [f"data: {n}" for n in dict.fromkeys(notes) if n]


def _source(ds: Any) -> str:
    if hasattr(ds, "describe"):  # SFT conversations (data/sft/dataset.py)
        return ds.describe()
    if not isinstance(ds, (GPTDataset, MockGPTDataset)):
        return ""
    docs = "document" if ds.num_documents == 1 else "documents"
    return (f" from {ds.num_documents:,} {docs}, {ds.tokens_per_epoch:,} tokens, "
            f"{ds.num_epochs} epoch{'s' if ds.num_epochs != 1 else ''} of {ds.source}")
