"""Train a SentencePiece model from raw text files, so users can start from a plain corpus.

The defaults keep text exactly recoverable (identity normalisation, whitespace kept, byte
fallback for unseen characters), which matters for code and for round-trip checks.
"""
from __future__ import annotations

import os
from typing import Iterator, List, Sequence

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


def iter_lines(files: Sequence[str], max_bytes: int = 0) -> Iterator[str]:
    """Non-empty lines of `files` (undecodable bytes replaced), up to `max_bytes` in total."""
    total = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
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
                        num_threads: int = 2, suffixes: Sequence[str] = ()) -> str:
    """Train on the lines of `inputs` (files or folders); returns the `.model` path.

    Ids: 0 <unk>, 1 <s> (bos), 2 </s> (eos, used as end-of-document), no pad.
    """
    import sentencepiece

    if vocab_size < 8:
        raise ValueError(f"--vocab-size {vocab_size} is too small for SentencePiece")
    files = list_text_files(inputs, suffixes)
    folder = os.path.dirname(os.path.abspath(model_prefix))
    os.makedirs(folder, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter_lines(files, max_bytes), model_prefix=model_prefix,
        vocab_size=vocab_size, model_type=model_type, input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True, character_coverage=character_coverage,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, split_digits=True, byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=num_threads,
        max_sentence_length=16384, minloglevel=2)
    return model_prefix + ".model"
