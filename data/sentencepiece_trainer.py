"""Train a SentencePiece model from raw text files, so users can start from a plain corpus.

The defaults keep text exactly recoverable (identity normalisation, whitespace kept, byte
fallback for unseen characters), which matters for code and for round-trip checks.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import Any, Iterator, List, Optional, Sequence

JSON_SUFFIXES = (".json", ".jsonl")  # JSON lines, read as tools/preprocess_data.py reads them
TEXT_SUFFIXES_SKIPPED = (".bin", ".idx", ".npy", ".model", ".gz", ".zip", ".pyc")


def list_text_files(inputs: Sequence[str], suffixes: Sequence[str] = ()) -> List[str]:
    """Files named in `inputs`, directories expanded recursively in sorted order."""
    files: List[str] = []
    for path in inputs:
        if os.path.isdir(path):
            for root, dirs, names in os.walk(path):
                dirs.sort()
                for name in sorted(names):
                    if suffixes and not name.endswith(tuple(suffixes)):
                        continue
                    if not suffixes and name.endswith(TEXT_SUFFIXES_SKIPPED):
                        continue
                    files.append(os.path.join(root, name))
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"--input {path}: no such file or directory")
    if not files:
        raise ValueError(f"--input {list(inputs)}: no text files found")
    return files


def _documents(path: str, json_keys: Sequence[str]) -> Iterator[str]:
    """The text of one file: its lines, or for JSON lines (.json/.jsonl, as preprocessing
    reads them) the `json_keys` string fields of each record, never the JSON syntax."""
    with open(path, encoding="utf-8", errors="replace") as f:
        if not path.endswith(JSON_SUFFIXES):
            yield from f
            return
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: malformed JSON ({err.msg}); a .json/.jsonl "
                                 f"input holds one JSON object per line") from None
            fields = [record.get(k) for k in json_keys] if isinstance(record, dict) else [None]
            texts = [t for t in fields if isinstance(t, str)]
            if len(texts) != len(fields):
                raise ValueError(f"{path}:{lineno}: no string field {list(json_keys)} "
                                 f"(--json-keys names the text fields)")
            for text in texts:
                yield from text.splitlines()


def iter_lines(files: Sequence[str], max_bytes: int = 0,
               json_keys: Sequence[str] = ("text",)) -> Iterator[str]:
    """Non-empty lines of `files` (undecodable bytes replaced), up to `max_bytes` in total."""
    total = 0
    for path in files:
        for line in _documents(path, json_keys):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            total += len(line)
            yield line
            if max_bytes and total >= max_bytes:
                return


def train_sentencepiece(inputs: Sequence[str], model_prefix: str, vocab_size: int = 32000,
                        model_type: str = "bpe", input_sentence_size: int = 1_000_000,
                        max_bytes: int = 0, character_coverage: float = 0.9999,
                        num_threads: int = 2, suffixes: Sequence[str] = (),
                        json_keys: Sequence[str] = ("text",)) -> str:
    """Train on the lines of `inputs` (files or folders); returns the `.model` path.

    Ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos, used as end-of-document), no pad.
    """
    import sentencepiece

    if vocab_size < 8:
        raise ValueError(f"--vocab-size {vocab_size} is too small for SentencePiece")
    files = list_text_files(inputs, suffixes)
    folder = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(folder, exist_ok=True)
    try:
        _train(sentencepiece, files, model_prefix, vocab_size, model_type, input_sentence_size,
               max_bytes, character_coverage, num_threads, json_keys)
    except RuntimeError as err:  # SentencePiece's own words name neither the flag nor the fix
        most = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= "
                         r"(\d+)", str(err))
        if most is None:
            raise
        raise ValueError(f"--vocab-size {vocab_size} is more than this text gives (at most "
                         f"{most.group(1)} pieces): give --vocab-size {most.group(1)} or less, "
                         f"or more text") from None
    return model_prefix + ".model"


def _train(sentencepiece: Any, files: Sequence[str], model_prefix: str, vocab_size: int,
           model_type: str, input_sentence_size: int, max_bytes: int,
           character_coverage: float, num_threads: int, json_keys: Sequence[str]) -> None:
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter_lines(files, max_bytes, json_keys), model_prefix=model_prefix,
        vocab_size=vocab_size, model_type=model_type, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True, character_coverage=character_coverage,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=num_threads,
        max_sentence_length=16384, minloglevel=2)


def get_parser() -> argparse.ArgumentParser:
    """Flags of `gigatron train-tokenizer` (and tools/train_tokenizer.py)."""
    p = argparse.ArgumentParser(description="Train a SentencePiece model", allow_abbrev=False)
    p.add_argument("--input", nargs="+", required=True, help="text files or folders")
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--vocab-size", type=int, default=32000, help="pieces in the vocabulary (default: %(default)s)")
    p.add_argument("--model-type", choices=("bpe", "unigram", "char", "word"), default="bpe",
                   help="SentencePiece algorithm (default: %(default)s)")
    p.add_argument("--input-sentence-size", type=int, default=1_000_000,
                   help="lines sampled for training (0 = all) (default: %(default)s)")
    p.add_argument("--max-bytes", type=int, default=0,
                   help="read at most this much text (0 = all) (default: %(default)s)")
    p.add_argument("--character-coverage", type=float, default=0.9999,
                   help="share of characters the vocabulary must cover (default: %(default)s)")
    p.add_argument("--suffixes", nargs="*", default=[],
                   help="in folders, only files ending so (e.g. .txt .py) (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="trainer threads (default: %(default)s)")
    p.add_argument("--json-keys", nargs="+", default=["text"],
                   help="in .json/.jsonl inputs, the fields holding the text, as "
                        "preprocess-data reads them (default: %(default)s)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Train a tokenizer from the command line; errors are one line, exit status 1."""
    args = get_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        model = train_sentencepiece(args.input, args.model_prefix, args.vocab_size,
                                    args.model_type, args.input_sentence_size, args.max_bytes,
                                    args.character_coverage, args.threads, args.suffixes,
                                    args.json_keys)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {model} in {time.perf_counter() - start:.1f} s")
    return 0
