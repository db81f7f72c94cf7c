"""Bad data said clearly when it is opened: ids outside the vocabulary, an empty split that
evaluation needs; and the dataset summary printed at start-up."""
import numpy as np
import pytest

from gigatron.data.builder import (GPTDataConfig, build_train_valid_test_datasets,
                                   describe_datasets)
from gigatron.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from gigatron.data.token_range import max_token_id, scan_max_token

SEQ = 8


def _data(prefix, docs, dtype=np.int32):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for tokens in docs:
        builder.add_document(np.asarray(tokens), [len(tokens)])
    builder.finalize(prefix + ".idx")
    return prefix


def _docs(n, high, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(rng.integers(5, 30))) for _ in range(n)]


def test_ids_past_the_vocabulary_name_the_file_and_the_flags(tmp_path):
    docs = _docs(20, 100)
    docs[7][3] = 500  # one id past a 300-id vocabulary
    prefix = _data(str(tmp_path / "corpus"), docs)
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="1,0,0", vocab_size=300)
    with pytest.raises(ValueError) as err:
        build_train_valid_test_datasets(config, [10, 0, 0])
    msg = str(err.value)
    assert "corpus.bin holds token id 500" in msg and "vocabulary of 300" in msg
    assert "--tokenizer-type" in msg and "--vocab-size" in msg
    ok = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="1,0,0", vocab_size=501)
    assert len(build_train_valid_test_datasets(ok, [10, 0, 0])[0]) >= 10


def test_the_largest_id_is_scanned_once_and_cached(tmp_path, monkeypatch):
    prefix = _data(str(tmp_path / "c"), _docs(10, 1000))
    ds = IndexedDataset(prefix)
    truth = max(int(d.max()) for d in ds)
    assert max_token_id(ds, str(tmp_path)) == truth
    import gigatron.data.token_range as tr
    monkeypatch.setattr(tr, "scan_max_token", lambda data: pytest.fail("scanned again"))
    assert max_token_id(ds, str(tmp_path)) == truth
    assert scan_max_token(np.arange(10 ** 5) % 977) == 976


def test_small_token_dtypes_skip_the_scan(tmp_path, monkeypatch):
    prefix = _data(str(tmp_path / "u8"), _docs(10, 250), dtype=np.uint8)
    import gigatron.data.token_range as tr
    monkeypatch.setattr(tr, "max_token_id", lambda *a: pytest.fail("uint8 cannot exceed 300"))
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="1,0,0", vocab_size=300)
    build_train_valid_test_datasets(config, [10, 0, 0])


def test_an_empty_split_that_evaluation_needs_names_split(tmp_path):
    prefix = _data(str(tmp_path / "few"), _docs(10, 100))
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="969,30,1")
    with pytest.raises(ValueError) as err:
        build_train_valid_test_datasets(config, [10, 8, 0])
    msg = str(err.value)
    assert "the valid split is empty: --split 969,30,1 gives it no documents" in msg, msg
    assert "10 in" in msg and "--eval-iters 0" in msg
    assert "e.g. --split 8,1,1 (one of the 10 documents each for valid and test)" in msg, msg
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="8,1,1")  # as suggested
    assert all(d is not None for d in build_train_valid_test_datasets(config, [10, 8, 8]))
    # a share of 0 is the user's choice, not an accident: no evaluation, no error
    config = GPTDataConfig(seq_length=SEQ, data_path=[prefix], split="100,0,0")
    assert build_train_valid_test_datasets(config, [10, 8, 8])[1:] == [None, None]


def test_summary_names_samples_documents_tokens_epochs_per_split_and_source(tmp_path):
    a = _data(str(tmp_path / "a"), _docs(40, 100))
    b = _data(str(tmp_path / "b"), _docs(40, 100, seed=1))
    config = GPTDataConfig(seq_length=SEQ, data_path=["0.25", a, "0.75", b], split="9,1,0")
    lines = describe_datasets(build_train_valid_test_datasets(config, [200, 16, 0]))
    text = "\n".join(lines)
    assert lines[0] == "data train: 200 samples blended from 2 sources", text
    assert "weight 0.250: 50 samples from 36 documents" in text, text
    assert "weight 0.750: 150 samples from 36 documents" in text, text
    assert "epochs of" in text or "epoch of" in text
    assert "data test: none" in text
