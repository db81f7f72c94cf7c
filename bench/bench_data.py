#!/usr/bin/env python
"""Data-pipeline benchmarks: preprocessing throughput and GPT index building.

    python bench/bench_data.py                      # everything, defaults below
    python bench/bench_data.py --skip-preprocess    # only index building
    python bench/bench_data.py --corpus-mb 8 --workers 1 2 --tokens 1e9 --documents 1e6

Preprocessing: JSON lines made from the Python standard library's source (real text present
everywhere), tokenized with a byte-level BPE (GPT2BPETokenizer, trained here with the
`tokenizers` trainer) and a SentencePiece model (trained here), at each --workers count.
Index building: document/sample/shuffle indices for `--tokens` tokens in `--documents`
documents at `--seq-length` (from the sizes array alone; no token file is written).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import resource

import numpy as np

from gigatron.data.sample_index import build_gpt_indices

STDLIB = os.path.dirname(os.__file__)


def make_corpus(path: str, megabytes: float) -> int:
    """JSON lines of standard-library source files until `megabytes` MB; returns bytes."""
    total, limit = 0, int(megabytes * 1e6)
    with open(path, "w", encoding="utf-8") as out:
        for root, dirs, files in os.walk(STDLIB):
            dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "test", "__pycache__"))
            for name in sorted(files):
                if not name.endswith(".py"):
                    continue
                text = open(os.path.join(root, name), encoding="utf-8", errors="replace").read()
                out.write(json.dumps({"text": text}) + "\n")
                total += len(text.encode("utf-8"))
                if total >= limit:
                    return total
    return total


def train_tokenizers(folder: str, corpus_file: str) -> dict:
    """GPT2BPE (vocab 8000) and SentencePiece (vocab 8000) flags, trained on the corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from gigatron.data.sentencepiece_trainer import train_sentencepiece

    texts = [json.loads(line)["text"] for line in open(corpus_file, encoding="utf-8")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts[:300], trainer)
    vocab, merges = tok.model.save(folder)
    text_file = os.path.join(folder, "sp_input.txt")
    with open(text_file, "w", encoding="utf-8") as f:
        f.write("\n".join(texts[:300]))
    model = train_sentencepiece([text_file], os.path.join(folder, "spm"), vocab_size=8000,
                                input_sentence_size=200_000)
    return {"GPT2BPETokenizer": ["--vocab-file", vocab, "--merge-file", merges],
            "SentencePieceTokenizer": ["--tokenizer-model", model]}


def cpu_seconds() -> float:
    """User+system CPU time of this process and its reaped children (the worker pool)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def bench_preprocess(args) -> list:
    from gigatron.data.preprocess import get_parser, run

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        corpus = os.path.join(folder, "corpus.jsonl")
        nbytes = make_corpus(corpus, args.corpus_mb)
        tokenizers = train_tokenizers(folder, corpus)
        for name, flags in tokenizers.items():
            for workers in args.workers:
                argv = ["--input", corpus, "--output-prefix", os.path.join(folder, "out"),
                        "--tokenizer-type", name, "--workers", str(workers), "--append-eod",
                        "--log-interval", "1000000"] + flags
                cpu = cpu_seconds()
                stats = run(get_parser().parse_args(argv))
                cpu = cpu_seconds() - cpu
                rows.append({"tokenizer": name, "workers": workers, "MB": nbytes / 1e6,
                             "seconds": stats["seconds"],
                             "MB/s": nbytes / 1e6 / stats["seconds"],
                             "docs/s": stats["documents"] / stats["seconds"],
                             "tokens/s": stats["tokens"] / stats["seconds"],
                             "cpu_seconds": cpu, "MB_per_cpu_second": nbytes / 1e6 / cpu,
                             "load_average": os.getloadavg()[0]})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def bench_index(args) -> dict:
    tokens, documents = int(float(args.tokens)), int(float(args.documents))
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 2 * tokens // documents, documents).astype(np.int32)
    sizes[0] += tokens - int(sizes.astype(np.int64).sum())  # exactly `tokens` in total
    num_samples = (tokens - 1) // args.seq_length  # one epoch
    start, cpu = time.perf_counter(), cpu_seconds()
    doc, sample, shuffle = build_gpt_indices(sizes, np.arange(documents), args.seq_length,
                                             num_samples, seed=1234)
    built, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        for name, array in (("doc", doc), ("sample", sample), ("shuffle", shuffle)):
            np.save(os.path.join(folder, name + ".npy"), array)
        saved = time.perf_counter() - start
    row = {"tokens": tokens, "documents": documents, "seq_length": args.seq_length,
           "samples": len(shuffle), "build_seconds": built, "build_cpu_seconds": cpu,
           "save_seconds": saved, "load_average": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    return row


def bench_read(args, tokens: int = 20_000_000, reads: int = 2000) -> dict:
    """Samples/s of GPTDataset.__getitem__ on a memory-mapped uint16 file (random order)."""
    from gigatron.data import GPTDataset, IndexedDataset, IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        prefix = os.path.join(folder, "read")
        builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
        sizes = rng.integers(1, 2000, tokens // 1000)
        stream = rng.integers(0, 50000, int(sizes.sum()), dtype=np.uint16)
        for start, n in zip(np.cumsum(sizes) - sizes, sizes):
            builder.add_item(stream[start:start + n])
            builder.end_document()
        builder.finalize(prefix + ".idx")
        data = IndexedDataset(prefix)
        ds = GPTDataset(data, np.arange(len(data)), reads, args.seq_length, seed=1)
        start = time.perf_counter()
        for i in range(reads):
            ds[i]
        seconds = time.perf_counter() - start
    row = {"read_samples": reads, "seq_length": args.seq_length,
           "samples/s": reads / seconds, "load_average": os.getloadavg()[0]}
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--corpus-mb", type=float, default=8.0)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", default="1e9")
    p.add_argument("--documents", default="1e6")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--skip-preprocess", action="store_true")
    p.add_argument("--skip-index", action="store_true")
    args = p.parse_args()
    print(f"# host: {os.cpu_count()} cpus, python {sys.version.split()[0]}, "
          f"numpy {np.__version__}", flush=True)
    if not args.skip_index:
        bench_index(args)
        bench_read(args)
    if not args.skip_preprocess:
        bench_preprocess(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
