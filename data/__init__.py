"""Megatron-compatible indexed data, GPT samples, blending, tokenizers, preprocessing.

Entry points for training:
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)
    config = GPTDataConfig(seq_length=..., data_path=[...], eod=tokenizer.eod, ...)
    train, valid, test = build_train_valid_test_datasets(config, [n_train, n_valid, n_test],
                                                         group=groups.dp)  # or None
    loader = build_pretraining_data_loader(train, consumed_samples, micro_batch_size,
                                           dp_rank, dp_size)  # yields micro-batch dicts
"""
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gigatron.data.blended_dataset import BlendedDataset, blend_indices, parse_data_path
    from gigatron.data.builder import GPTDataConfig, build_train_valid_test_datasets
    from gigatron.data.gpt_dataset import GPTDataset
    from gigatron.data.mock_dataset import MockGPTDataset, MockIndexedDataset
    from gigatron.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                               IndexedDatasetError, token_dtype_for_vocab)
    from gigatron.data.samplers import PretrainingSampler, build_pretraining_data_loader
    from gigatron.data.tokenizer import Tokenizer, build_tokenizer

# name -> its module, imported on first use: `import gigatron.data.tokenizer` (flag parsing)
# does not pull torch in through the datasets
_HOMES = {"BlendedDataset": "blended_dataset", "blend_indices": "blended_dataset",
          "parse_data_path": "blended_dataset", "GPTDataConfig": "builder",
          "build_train_valid_test_datasets": "builder", "GPTDataset": "gpt_dataset",
          "MockIndexedDataset": "mock_dataset", "MockGPTDataset": "mock_dataset",
          "IndexedDataset": "indexed_dataset",
          "IndexedDatasetBuilder": "indexed_dataset", "IndexedDatasetError": "indexed_dataset",
          "token_dtype_for_vocab": "indexed_dataset", "PretrainingSampler": "samplers",
          "build_pretraining_data_loader": "samplers", "Tokenizer": "tokenizer",
          "build_tokenizer": "tokenizer"}
__all__ = list(_HOMES)


def __getattr__(name: str) -> Any:
    """The public names, each from its module on first use."""
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"gigatron.data.{_HOMES[name]}"), name)
