"""Train a SentencePiece tokenizer on text files or folders."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron train-tokenizer --input corpus/ --model-prefix my-data/spm --vocab-size 32000`."""
    from gigatron.data.sentencepiece_trainer import main as trainer_main

    return trainer_main(argv)
