"""--mock-data is Megatron-Core's mock data set (documents, lengths, tokens), with its samples
computed per index so that ~200M tokens per epoch cost nothing to set up."""
import types

import numpy as np
import pytest

from gigatron.data.builder import GPTDataConfig, build_train_valid_test_datasets
from gigatron.data.mock_dataset import MockGPTDataset, MockIndexedDataset, keyed_permutation

VOCAB, EOD = 50257, 50256  # GPT-2's: no document reaches the eod id before its end


def test_documents_are_megatron_cores_mock_documents():
    MockGPTLowLevelDataset = pytest.importorskip(
        "megatron.core.datasets.gpt_dataset").MockGPTLowLevelDataset
    for vocab, eod in ((VOCAB, EOD), (300, 7)):  # a small vocabulary wraps the tokens
        theirs = MockGPTLowLevelDataset(types.SimpleNamespace(vocab_size=vocab, eod=eod))
        ours = MockIndexedDataset(vocab, eod)
        assert len(ours) == len(theirs) == 100_000
        np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
        for idx in (0, 1, 2, 777, 54_321, 99_990, 99_999):
            size = int(ours.sequence_lengths[idx])
            np.testing.assert_array_equal(ours.get(idx), theirs[idx])
            assert ours.get(idx).dtype == theirs[idx].dtype == np.int64
            for offset, length in ((0, 1), (1, None), (size // 2, size - size // 2),
                                   (size - 1, 1)):
                np.testing.assert_array_equal(ours.get(idx, offset, length),
                                              theirs.get(idx, offset, length))


def test_megatron_mixtral_split_with_ten_eval_iters_has_valid_and_test_samples():
    # Megatron-LM's Mixtral example: --mock-data --split 99990,8,2 --eval-iters 10,
    # --seq-length 4096 --global-batch-size 256
    config = GPTDataConfig(seq_length=4096, mock_data=True, eod=EOD, vocab_size=VOCAB,
                           split="99990,8,2")
    train, valid, test = build_train_valid_test_datasets(config, [256 * 100, 2560, 2560])
    assert (train.num_documents, valid.num_documents, test.num_documents) == (99_990, 8, 2)
    assert len(valid) >= 2560 and len(test) >= 2560
    for split in (valid, test):  # the test split's 869 tokens per epoch: samples span epochs
        sample = split[len(split) - 1]
        assert sample["tokens"].shape == (4096,) and sample["labels"].shape == (4096,)
    valid_documents = np.arange(99_990, 99_998)
    assert valid.tokens_per_epoch == int(valid.indexed_dataset.sequence_lengths[
        valid_documents].sum())


def test_every_epoch_lays_out_each_document_once_and_samples_tile_it():
    config = GPTDataConfig(seq_length=64, mock_data=True, eod=EOD, vocab_size=VOCAB,
                           split="99990,8,2", seed=3)
    valid = build_train_valid_test_datasets(config, [1, 300, 0])[1]
    assert isinstance(valid, MockGPTDataset) and valid.num_epochs >= 2
    total, seq = valid.tokens_per_epoch, valid.seq_length
    stream = valid._stream(0, 2 * total + seq)
    for epoch in range(2):  # each document once, whole, in a shuffled order
        part = stream[epoch * total:(epoch + 1) * total]
        ends = np.flatnonzero(part == EOD) + 1
        documents = np.split(part, ends[:-1])
        assert ends[-1] == total and len(documents) == 8
        assert sorted(map(len, documents)) == sorted(valid.sizes.tolist())
        assert all(d[0] == 1 or len(d) == 1 for d in documents)
    assert not np.array_equal(stream[:total], stream[total:2 * total])  # reshuffled
    per_epoch = -(-total // seq)
    starts = set()
    for idx in range(per_epoch):  # the first epoch's samples: every window, once
        tokens = valid.sample_tokens(idx)
        found = [j for j in range(per_epoch + 1)
                 if np.array_equal(stream[j * seq:j * seq + seq + 1], tokens)]
        starts.update(found[:1])
    assert starts == set(range(per_epoch))
    assert [valid.sample_tokens(i).tolist() for i in range(5)] != \
        [stream[j * seq:j * seq + seq + 1].tolist() for j in range(5)]  # not in stream order


def test_samples_are_deterministic_per_seed_and_checked_for_range():
    def first_tokens(seed):
        config = GPTDataConfig(seq_length=16, mock_data=True, eod=EOD, vocab_size=VOCAB,
                               seed=seed)
        train = build_train_valid_test_datasets(config, [100, 0, 0])[0]
        return [train[i]["tokens"].tolist() for i in range(20)], train

    (same, train), (again, _), (other, _) = first_tokens(1), first_tokens(1), first_tokens(2)
    assert same == again and same != other
    with pytest.raises(IndexError, match="out of range"):
        train.sample_tokens(len(train))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 100, 1000])
def test_keyed_permutation_is_a_bijection(n):
    for key in (0, 1, 123_456_789_012):
        assert sorted(keyed_permutation(k, n, key) for k in range(n)) == list(range(n))
    if n >= 7:
        assert [keyed_permutation(k, n, 5) for k in range(n)] != list(range(n))
