"""Megatron's memory-mapped indexed dataset (`.bin` tokens + `.idx` index, MMIDIDX version 1).

`.idx` layout (little-endian): 9-byte magic `MMIDIDX\\x00\\x00`, u64 version (1), u8 dtype code,
u64 sequence count N, u64 document-index length D (= documents + 1), int32 sizes[N],
int64 byte pointers[N] into `.bin`, int64 document index[D] (sequence number where each
document starts, then N). `.bin` holds the raw tokens of all sequences back to back.

The reader maps both files and reads only the sequences asked for; every structural fact is
checked before use, so a corrupt or truncated file raises `IndexedDatasetError` naming the file
instead of returning wrong tokens.
"""
from __future__ import annotations

import os
import struct
from typing import Iterable, List, Optional, Sequence, Union

import numpy as np
import numpy.typing as npt

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
               6: np.float64, 7: np.float32, 8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class IndexedDatasetError(ValueError):
    """A `.bin`/`.idx` pair is not a valid MMIDIDX v1 dataset (the message names the file)."""


def data_file_path(prefix: str) -> str:
    """The token file of the dataset at `prefix` (Megatron passes prefixes, not file names)."""
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    """The index file of the dataset at `prefix`."""
    return prefix + ".idx"


def token_dtype_for_vocab(vocab_size: int) -> type:
    """Megatron's rule: uint16 tokens when the vocabulary fits comfortably, else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def write_index(path: str, token_dtype: "npt.DTypeLike", sizes: np.ndarray,
                document_index: np.ndarray) -> None:
    """Write a `.idx` file for sequences of `sizes` tokens laid out back to back in `.bin`."""
    dtype: np.dtype = np.dtype(token_dtype)
    if dtype not in CODE_OF_DTYPE:
        raise ValueError(f"token dtype {dtype} has no MMIDIDX code; use one of "
                         f"{sorted(str(d) for d in CODE_OF_DTYPE)}")
    sizes = np.asarray(sizes, dtype=np.int32)
    pointers = np.zeros(len(sizes), dtype=np.int64)
    if len(sizes) > 1:
        np.cumsum(sizes[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    document_index = np.asarray(document_index, dtype=np.int64)
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(sizes)))
        f.write(struct.pack("<Q", len(document_index)))
        f.write(sizes.astype("<i4").tobytes(order="C"))
        f.write(pointers.astype("<i8").tobytes(order="C"))
        f.write(document_index.astype("<i8").tobytes(order="C"))


class IndexedDatasetBuilder:
    """Streams sequences into `.bin` and writes the matching `.idx` at `finalize`."""

    def __init__(self, bin_path: str, dtype: "npt.DTypeLike" = np.int32) -> None:
        self.dtype: np.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        self.bin_path = bin_path
        self._file = open(bin_path, "wb")
        self.sequence_lengths: List[int] = []
        self.document_indices: List[int] = [0]

    def add_item(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one sequence (not yet closing its document)."""
        array = np.asarray(tokens)
        if array.size and self.dtype.kind in "iu":
            info, lo, hi = np.iinfo(self.dtype), array.min(), array.max()
            if lo < info.min or hi > info.max:
                raise ValueError(f"token {lo if lo < info.min else hi} does not fit dtype "
                                 f"{self.dtype}; use int32 tokens for vocabularies >= 65500")
        self._file.write(array.astype(self.dtype, copy=False).tobytes(order="C"))
        self.sequence_lengths.append(int(array.size))

    def end_document(self) -> None:
        """Close the current document after the sequences added so far."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens: Sequence[int], lengths: Iterable[int]) -> None:
        """Append a document made of consecutive sequences of `lengths` tokens."""
        array = np.asarray(tokens)
        start = 0
        for n in lengths:
            self.add_item(array[start:start + n])
            start += n
        if start != array.size:
            raise ValueError(f"add_document: lengths sum to {start}, tokens have {array.size}")
        self.end_document()

    def finalize(self, idx_path: str) -> None:
        """Close `.bin` and write `.idx` (documents left open are closed first)."""
        self._file.close()
        if self.document_indices[-1] != len(self.sequence_lengths):
            self.end_document()
        write_index(idx_path, self.dtype, np.array(self.sequence_lengths, dtype=np.int64),
                    np.array(self.document_indices, dtype=np.int64))

    def abort(self) -> None:
        """Close the `.bin` file without writing an index (the caller removes it)."""
        self._file.close()


def _read_header(path: str, buffer: np.ndarray):
    if len(buffer) < HEADER_BYTES:
        raise IndexedDatasetError(f"{path}: truncated index ({len(buffer)} bytes, the header "
                                  f"alone needs {HEADER_BYTES})")
    header = bytes(buffer[:HEADER_BYTES])
    if header[:9] != MAGIC:
        raise IndexedDatasetError(f"{path}: bad magic {header[:9]!r}, expected {MAGIC!r}: "
                                  f"not a Megatron MMIDIDX index file")
    version, code, count, doc_count = struct.unpack("<QBQQ", header[9:])
    if version != VERSION:
        raise IndexedDatasetError(f"{path}: index version {version}, only version {VERSION} "
                                  f"is supported")
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(f"{path}: unknown dtype code {code} (valid: "
                                  f"{sorted(DTYPE_CODES)})")
    expected = HEADER_BYTES + 4 * count + 8 * count + 8 * doc_count
    if len(buffer) != expected:
        what = "truncated" if len(buffer) < expected else "trailing bytes in"
        raise IndexedDatasetError(f"{path}: {what} index: {count} sequences and {doc_count} "
                                  f"document-index entries need {expected} bytes, file has "
                                  f"{len(buffer)}")
    return np.dtype(DTYPE_CODES[code]), int(count), int(doc_count)


def _map(path: str) -> np.ndarray:
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (a dataset needs both .bin and .idx; "
                                f"pass the prefix without the extension)")
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


class IndexedDataset:
    """Random access to the sequences of a `.bin/.idx` pair without loading the files."""

    def __init__(self, path_prefix: str) -> None:
        self.path_prefix = path_prefix
        self.idx_path, self.bin_path = index_file_path(path_prefix), data_file_path(path_prefix)
        self._index = _map(self.idx_path)
        self.dtype, count, doc_count = _read_header(self.idx_path, self._index)
        offset = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._index, "<i4", count, offset)
        offset += 4 * count
        self.sequence_pointers = np.frombuffer(self._index, "<i8", count, offset)
        offset += 8 * count
        self.document_indices = np.frombuffer(self._index, "<i8", doc_count, offset)
        self._data = _map(self.bin_path)
        self._check_structure()

    def _check_structure(self) -> None:
        n = len(self.sequence_lengths)
        doc = self.document_indices
        if len(doc) == 0 or doc[0] != 0 or doc[-1] != n:
            raise IndexedDatasetError(
                f"{self.idx_path}: document index must start at 0 and end at the sequence "
                f"count {n}; found {doc[:1].tolist()}..{doc[-1:].tolist()}")
        if n == 0:
            return
        end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.itemsize
        if int(self.sequence_lengths[-1]) < 0 or end > len(self._data):
            raise IndexedDatasetError(
                f"{self.bin_path}: truncated data file: the index places the last sequence's "
                f"end at byte {end}, the file has {len(self._data)} bytes")

    def verify(self) -> None:
        """Full consistency check (every pointer, size and document boundary); O(N)."""
        sizes = self.sequence_lengths.astype(np.int64)
        if (sizes < 0).any():
            raise IndexedDatasetError(f"{self.idx_path}: negative sequence length")
        expected = np.zeros(len(sizes), dtype=np.int64)
        np.cumsum(sizes[:-1] * self.itemsize, out=expected[1:])
        if not np.array_equal(expected, self.sequence_pointers):
            bad = int(np.nonzero(expected != self.sequence_pointers)[0][0])
            raise IndexedDatasetError(f"{self.idx_path}: pointer of sequence {bad} is "
                                      f"{self.sequence_pointers[bad]}, expected {expected[bad]}")
        if (np.diff(self.document_indices) < 0).any():
            raise IndexedDatasetError(f"{self.idx_path}: document index is not increasing")
        if len(sizes) and expected[-1] + sizes[-1] * self.itemsize != len(self._data):
            raise IndexedDatasetError(f"{self.bin_path}: size {len(self._data)} bytes does not "
                                      f"match the index ({sizes.sum() * self.itemsize})")

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def num_documents(self) -> int:
        """Documents (groups of consecutive sequences); GPT samples treat sequences as documents."""
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens `offset : offset+length` of sequence `idx` (a read-only view of the map)."""
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"{self.path_prefix}: tokens [{offset}, {offset + length}) out of "
                             f"range for sequence {idx} of length {size}")
        start = int(self.sequence_pointers[idx]) + offset * self.itemsize
        if start < 0 or start + length * self.itemsize > len(self._data):
            raise IndexedDatasetError(f"{self.bin_path}: sequence {idx} points past the end of "
                                      f"the data file (corrupt index)")
        if length == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.frombuffer(self._data, self.dtype, length, start)

    def __getitem__(self, idx):
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {len(self)} sequences")
        return self.get(idx)

    def document(self, doc: int) -> np.ndarray:
        """All tokens of document `doc` (its sequences concatenated)."""
        lo, hi = int(self.document_indices[doc]), int(self.document_indices[doc + 1])
        parts = [self.get(i) for i in range(lo, hi)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=self.dtype)

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both files of the dataset at `path_prefix` are present."""
        return os.path.exists(index_file_path(path_prefix)) and os.path.exists(
            data_file_path(path_prefix))
