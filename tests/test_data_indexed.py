"""The .bin/.idx reader and builder follow Megatron's MMIDIDX v1 format byte for byte."""
import os
import struct

import numpy as np
import pytest

from gigatron.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder,
                                               IndexedDatasetError, token_dtype_for_vocab)


def _documents(rng, n_docs=40, vocab=50000):
    """Documents made of 1-3 sequences of 0-30 tokens (some empty)."""
    return [[rng.integers(0, vocab, rng.integers(0, 30)) for _ in range(rng.integers(1, 4))]
            for _ in range(n_docs)]


def _write(prefix, docs, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_document(np.concatenate(doc), [len(s) for s in doc])
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8])
def test_builder_write_then_read_back_identical(tmp_path, dtype):
    rng = np.random.default_rng(0)
    vocab = 250 if dtype == np.uint8 else 50000
    docs = _documents(rng, vocab=vocab)
    prefix = str(tmp_path / "d")
    _write(prefix, docs, dtype)
    ds = IndexedDataset(prefix)
    ds.verify()
    flat = [s for doc in docs for s in doc]
    assert ds.dtype == np.dtype(dtype) and len(ds) == len(flat) and ds.num_documents == len(docs)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i], seq)
        assert ds[i].dtype == np.dtype(dtype)
    for d, doc in enumerate(docs):
        np.testing.assert_array_equal(ds.document(d), np.concatenate(doc))
    # partial reads inside a sequence
    longest = int(np.argmax(ds.sequence_lengths))
    np.testing.assert_array_equal(ds.get(longest, 3, 5), flat[longest][3:8])
    with pytest.raises(IndexError):
        ds.get(longest, 3, len(flat[longest]))


def test_written_idx_bytes_follow_the_format_field_by_field(tmp_path):
    prefix = str(tmp_path / "d")
    docs = [[np.array([5, 6, 7])], [np.array([1]), np.array([2, 3])], [np.array([], int)]]
    _write(prefix, docs, np.uint16)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    assert struct.unpack("<Q", raw[9:17]) == (1,)          # version
    assert raw[17] == 8                                     # uint16 dtype code
    assert struct.unpack("<QQ", raw[18:34]) == (4, 4)       # 4 sequences, 3 docs + 1
    sizes = np.frombuffer(raw, "<i4", 4, 34)
    pointers = np.frombuffer(raw, "<i8", 4, 34 + 16)
    doc_index = np.frombuffer(raw, "<i8", 4, 34 + 16 + 32)
    assert sizes.tolist() == [3, 1, 2, 0]
    assert pointers.tolist() == [0, 6, 8, 12]               # bytes, 2 per uint16 token
    assert doc_index.tolist() == [0, 1, 3, 4]
    assert len(raw) == 34 + 16 + 32 + 32
    assert open(prefix + ".bin", "rb").read() == np.array([5, 6, 7, 1, 2, 3], "<u2").tobytes()


def _independent_write(prefix, seqs, doc_starts, code=4, np_dtype="<i4"):
    """A writer of the format that shares no code with ours."""
    sizes = [len(s) for s in seqs]
    item = np.dtype(np_dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(sizes)[:-1] * item]).astype("<i8")
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            f.write(np.asarray(s, np_dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_starts)))
        f.write(struct.pack(f"<{len(sizes)}i", *sizes))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers.tolist()))
        f.write(struct.pack(f"<{len(doc_starts)}q", *doc_starts))


def test_file_from_an_independent_writer_reads_correctly(tmp_path):
    prefix = str(tmp_path / "ext")
    seqs = [[70000, 1, 2], [3], [4, 5, 6, 7], [99999]]
    _independent_write(prefix, seqs, [0, 2, 4])
    ds = IndexedDataset(prefix)
    ds.verify()
    assert ds.dtype == np.int32 and len(ds) == 4 and ds.num_documents == 2
    assert [ds[i].tolist() for i in range(4)] == seqs
    assert ds.document(1).tolist() == [4, 5, 6, 7, 99999]
    assert ds.document_indices.tolist() == [0, 2, 4]


def _corrupt(tmp_path, how):
    prefix = str(tmp_path / "c")
    _independent_write(prefix, [[1, 2, 3], [4, 5]], [0, 1, 2])
    idx = bytearray(open(prefix + ".idx", "rb").read())
    if how == "magic":
        idx[0:4] = b"XXXX"
    elif how == "version":
        idx[9:17] = struct.pack("<Q", 2)
    elif how == "dtype":
        idx[17] = 42
    elif how == "count":  # claims more sequences than the file holds
        idx[18:26] = struct.pack("<Q", 1000)
    elif how == "truncated_idx":
        idx = idx[:-5]
    elif how == "short_header":
        idx = idx[:20]
    elif how == "truncated_bin":
        data = open(prefix + ".bin", "rb").read()
        open(prefix + ".bin", "wb").write(data[:-3])
    elif how == "doc_index":
        idx[-8:] = struct.pack("<q", 7)
    open(prefix + ".idx", "wb").write(bytes(idx))
    return prefix


@pytest.mark.parametrize("how,words", [
    ("magic", "bad magic"), ("version", "version 2"), ("dtype", "dtype code 42"),
    ("count", "truncated index"), ("truncated_idx", "truncated index"),
    ("short_header", "header"), ("truncated_bin", "truncated data file"),
    ("doc_index", "document index")])
def test_corrupt_or_truncated_files_raise_clear_error_naming_the_file(tmp_path, how, words):
    prefix = _corrupt(tmp_path, how)
    with pytest.raises(IndexedDatasetError) as err:
        IndexedDataset(prefix)
    assert words in str(err.value)
    assert str(tmp_path) in str(err.value)


def test_corrupt_pointer_is_caught_at_read_not_returned(tmp_path):
    prefix = str(tmp_path / "p")
    _independent_write(prefix, [[1, 2, 3], [4, 5], [6]], [0, 3])
    idx = bytearray(open(prefix + ".idx", "rb").read())
    idx[34 + 12 + 8: 34 + 12 + 16] = struct.pack("<q", 10_000)  # pointer of sequence 1
    open(prefix + ".idx", "wb").write(bytes(idx))
    ds = IndexedDataset(prefix)
    with pytest.raises(IndexedDatasetError, match="past the end"):
        ds[1]
    with pytest.raises(IndexedDatasetError, match="pointer of sequence 1"):
        ds.verify()


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.idx"):
        IndexedDataset(str(tmp_path / "nothere"))


def test_token_dtype_rule_and_overflow_is_refused(tmp_path):
    assert token_dtype_for_vocab(50257) == np.uint16
    assert token_dtype_for_vocab(65500) == np.int32
    builder = IndexedDatasetBuilder(str(tmp_path / "o.bin"), np.uint16)
    with pytest.raises(ValueError, match="does not fit"):
        builder.add_item([70000])
    builder.abort()


def test_reader_maps_instead_of_loading(tmp_path):
    prefix = str(tmp_path / "m")
    _write(prefix, _documents(np.random.default_rng(1)), np.int32)
    ds = IndexedDataset(prefix)
    assert isinstance(ds._data, np.memmap) and isinstance(ds._index, np.memmap)
    assert not ds[3].flags.writeable  # a view of the map, not a copy
    assert os.path.getsize(prefix + ".bin") == int(ds.sequence_lengths.sum()) * 4
