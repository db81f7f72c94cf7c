"""Tokenize raw documents into Megatron `.bin/.idx` files (the engine of tools/preprocess_data.py).

Input: JSON-lines files (`.json`, `.jsonl`; one document per line, text under --json-keys),
plain text files (one document per file) or folders of either. Output per key:
`{output_prefix}_{key}_document.bin/.idx`, written under temporary names and renamed into
place only when everything succeeded. Documents keep their input order whatever --workers is.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from typing import Dict, Generator, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from gigatron.data.indexed_dataset import IndexedDatasetBuilder, token_dtype_for_vocab
from gigatron.data.sentencepiece_trainer import JSON_SUFFIXES, list_text_files
from gigatron.data.tokenizer import TOKENIZER_TYPES, tokenizer_from_flags

CHUNK_RECORDS, CHUNK_BYTES = 256, 1 << 18  # small enough to balance the workers

# A record is (file, line number or 0 for a whole text file, raw text).
Record = Tuple[str, int, str]


def get_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True,
                   help="JSON-lines files, plain text files, or folders of them")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="keys of each JSON line to tokenize (one output per key) (default: %(default)s)")
    p.add_argument("--output-prefix", required=True,
                   help="writes PREFIX_KEY_document.bin/.idx for each JSON key")
    _add_tokenizer_args(p)
    p.add_argument("--append-eod", action="store_true", help="end each document with eod")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes (default: %(default)s)")
    p.add_argument("--log-interval", type=int, default=1000, help="documents between reports (default: %(default)s)")
    p.add_argument("--dataset-impl", choices=("mmap",), default="mmap",
                   help="accepted for older Megatron scripts; mmap is the only format (default: %(default)s)")
    p.add_argument("--invalid-json", choices=("error", "skip"), default="error",
                   help="a malformed JSON line stops the run (error) or is reported and "
                        "skipped (skip) (default: %(default)s)")
    return p


def _add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    """Megatron's tokenizer flags (docs/DATA.md: what each type needs)."""
    p.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES,
                   help="Megatron tokenizer name")
    p.add_argument("--tokenizer-model", help="SentencePiece .model, tokenizer.json or its "
                   "folder, or TikTokenizer's JSON vocabulary")
    p.add_argument("--vocab-file", help="GPT-2 vocab.json or BERT vocab.txt")
    p.add_argument("--merge-file", help="GPT2BPETokenizer merges.txt")
    p.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary (eod is its "
                   "last id); TikTokenizer's (default 131072)")
    p.add_argument("--null-tokenizer-eod-id", type=int, help="NullTokenizer's eod "
                   "(default: --vocab-size - 1)")
    p.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer's split "
                   "pattern (default v2)")
    p.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer's ids reserved for special tokens (default: %(default)s)")
    p.add_argument("--tokenizer-special-tokens", nargs="+", help="TikTokenizer's special "
                   "tokens (default <unk> <s> </s> <mask> <pad> <cls> <sep>)")
    p.add_argument("--tokenizer-hf-no-include-special-tokens", action="store_true",
                   help="HuggingFaceTokenizer: do not add the tokenizer's special tokens "
                   "(e.g. BOS) to each document")


def _records(files: Sequence[str]) -> Iterator[Record]:
    for path in files:
        if path.endswith(JSON_SUFFIXES):
            with open(path, encoding="utf-8", errors="replace") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield path, lineno, line
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield path, 0, f.read()


def _chunks(records: Iterator[Record]) -> Iterator[List[Record]]:
    chunk: List[Record] = []
    size = 0
    for record in records:
        chunk.append(record)
        size += len(record[2])
        if len(chunk) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class Encoder:
    """Parses and tokenizes chunks of records; lives once per worker process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.keys, self.append_eod = list(args.json_keys), args.append_eod
        self.tokenizer = tokenizer_from_flags(vars(args))
        self.dtype = token_dtype_for_vocab(self.tokenizer.vocab_size)

    def _texts(self, record: Record) -> Dict[str, str]:
        path, lineno, raw = record
        if lineno == 0:
            return {key: raw for key in self.keys}
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f"malformed JSON ({err.msg} at column {err.colno})")
        if not isinstance(doc, dict):
            raise ValueError("JSON line is not an object")
        missing = [k for k in self.keys if not isinstance(doc.get(k), str)]
        if missing:
            raise ValueError(f"no string field {missing} (--json-keys {' '.join(self.keys)})")
        return {key: doc[key] for key in self.keys}

    def encode(self, chunk: List[Record]) -> List[tuple]:
        """Per record: ("ok", {key: token array}, input bytes) or ("bad", file, line, reason)."""
        parsed: List[Optional[Dict[str, str]]] = []
        out: List[tuple] = []
        for record in chunk:
            try:
                parsed.append(self._texts(record))
            except ValueError as err:
                parsed.append(None)
                out.append(("bad", record[0], record[1], str(err)))
        good = [p for p in parsed if p is not None]
        ids = {k: self.tokenizer.tokenize_batch([p[k] for p in good]) for k in self.keys}
        results: List[tuple] = []
        g = 0
        eod = [self.tokenizer.eod] if self.append_eod else []
        bad = iter(out)
        for p in parsed:
            if p is None:
                results.append(next(bad))
                continue
            arrays: Dict[str, np.ndarray] = {
                k: np.asarray(ids[k][g] + eod, dtype=self.dtype) for k in self.keys}
            nbytes = sum(len(p[k].encode("utf-8")) for k in self.keys)
            results.append(("ok", arrays, nbytes))
            g += 1
        return results


_WORKER_ENCODER: Optional[Encoder] = None  # one per pool worker process


def _init_worker(args: argparse.Namespace) -> None:
    global _WORKER_ENCODER
    _WORKER_ENCODER = Encoder(args)


def _encode_in_worker(chunk: List[Record]) -> List[tuple]:
    assert _WORKER_ENCODER is not None, "the pool initializer builds the encoder"
    return _WORKER_ENCODER.encode(chunk)


def output_paths(prefix: str, key: str) -> Tuple[str, str]:
    base = f"{prefix}_{key}_document"
    return base + ".bin", base + ".idx"


class _Progress:
    def __init__(self, interval: int) -> None:
        self.interval, self.start = max(1, interval), time.perf_counter()
        self.docs = self.bytes = self.tokens = 0

    def add(self, nbytes: int, ntokens: int) -> None:
        self.docs += 1
        self.bytes += nbytes
        self.tokens += ntokens
        if self.docs % self.interval == 0:
            print(self.line("processed"), file=sys.stderr, flush=True)

    def line(self, what: str) -> str:
        dt = max(time.perf_counter() - self.start, 1e-9)
        return (f"{what} {self.docs} documents, {self.tokens} tokens in {dt:.1f} s "
                f"({self.docs / dt:.1f} docs/s, {self.bytes / dt / 1e6:.2f} MB/s)")


def _encoded_chunks(args: argparse.Namespace,
                    files: List[str]) -> Generator[List[tuple], None, None]:
    chunks = _chunks(_records(files))
    if args.workers <= 1:
        encoder = Encoder(args)
        for chunk in chunks:
            yield encoder.encode(chunk)
        return
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(args.workers, initializer=_init_worker, initargs=(args,)) as pool:
        yield from pool.imap(_encode_in_worker, chunks)


def run(args: argparse.Namespace) -> dict:
    """Tokenize everything into temporary files, then rename them into place; returns stats."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # --workers is the parallelism
    files = list_text_files(args.input)
    dtype = Encoder(args).dtype  # also validates the tokenizer flags before any work
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(folder, exist_ok=True)
    finals = {k: output_paths(args.output_prefix, k) for k in args.json_keys}
    temps = {k: tuple(f"{p}.tmp-{os.getpid()}" for p in finals[k]) for k in args.json_keys}
    builders = {k: IndexedDatasetBuilder(temps[k][0], dtype) for k in args.json_keys}
    progress, skipped = _Progress(args.log_interval), []
    encoded = _encoded_chunks(args, files)
    try:
        for results in encoded:
            for result in results:
                if result[0] == "bad":
                    _, path, lineno, reason = result
                    if args.invalid_json == "error":
                        raise ValueError(f"{path}:{lineno}: {reason} (pass --invalid-json skip "
                                         f"to skip such lines)")
                    print(f"skipping {path}:{lineno}: {reason}", file=sys.stderr)
                    skipped.append((path, lineno))
                    continue
                _, arrays, nbytes = result
                for key, tokens in arrays.items():
                    builders[key].add_document(tokens, [len(tokens)])
                progress.add(nbytes, sum(len(t) for t in arrays.values()))
        for key, builder in builders.items():
            builder.finalize(temps[key][1])
        for key in args.json_keys:
            for tmp, final in zip(temps[key], finals[key]):
                os.replace(tmp, final)
    finally:
        encoded.close()  # stops the worker pool now, also on failure
        for key, builder in builders.items():
            builder.abort()
            for tmp in temps[key]:
                if os.path.exists(tmp):
                    os.remove(tmp)
    print(progress.line("done:"), file=sys.stderr, flush=True)
    if skipped:
        print(f"skipped {len(skipped)} malformed lines, first: {skipped[:10]}", file=sys.stderr)
    return {"documents": progress.docs, "tokens": progress.tokens, "bytes": progress.bytes,
            "skipped": skipped, "seconds": time.perf_counter() - progress.start,
            "outputs": finals}


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = get_parser().parse_args(argv)
    if args.workers < 1:
        print("error: --workers must be at least 1", file=sys.stderr)
        return 2
    try:
        run(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
