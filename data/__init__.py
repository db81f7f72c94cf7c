"""Megatron-compatible indexed data, GPT samples, blending, tokenizers, preprocessing.

Entry points for training:
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=..., merge_file=...)
    config = GPTDataConfig(seq_length=..., data_path=[...], eod=tokenizer.eod, ...)
    train, valid, test = build_train_valid_test_datasets(config, [n_train, n_valid, n_test],
                                                         group=groups.dp)  # or None
    loader = build_pretraining_data_loader(train, consumed_samples, micro_batch_size,
                                           dp_rank, dp_size)  # yields micro-batch dicts
"""
from gigatron.data.blended_dataset import BlendedDataset, blend_indices, parse_data_path
from gigatron.data.builder import GPTDataConfig, build_train_valid_test_datasets
from gigatron.data.gpt_dataset import GPTDataset, MockIndexedDataset
from gigatron.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                               IndexedDatasetError, token_dtype_for_vocab)
from gigatron.data.samplers import PretrainingSampler, build_pretraining_data_loader
from gigatron.data.tokenizer import Tokenizer, build_tokenizer

__all__ = [
    "BlendedDataset", "blend_indices", "parse_data_path", "GPTDataConfig",
    "build_train_valid_test_datasets", "GPTDataset", "MockIndexedDataset",
    "IndexedDataset", "IndexedDatasetBuilder", "IndexedDatasetError", "token_dtype_for_vocab",
    "PretrainingSampler", "build_pretraining_data_loader", "Tokenizer", "build_tokenizer",
]
