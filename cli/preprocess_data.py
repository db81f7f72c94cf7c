"""Tokenize JSON lines or text into Megatron .bin/.idx files."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron preprocess-data --input corpus.jsonl --output-prefix my-data/corpus ...`."""
    from gigatron.data.preprocess import main as preprocess_main

    return preprocess_main(argv)
