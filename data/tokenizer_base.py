"""The tokenizer interface preprocessing and training rely on (Megatron's: eod, vocab_size,
tokenize, detokenize), and the checks every tokenizer's files share."""
from __future__ import annotations

import abc
import os
from typing import List, Optional, Sequence


class Tokenizer(abc.ABC):
    """What preprocessing and training need of a tokenizer."""

    name = "abstract"

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover (before Megatron's padding)."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """The end-of-document id appended by --append-eod."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text to ids."""

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Several texts to ids (a tokenizer with a batch encoder overrides this)."""
        return [self.tokenize(t) for t in texts]

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids back to text."""


def require_file(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    """`path`, or a one-line error naming the flag when it is missing or does not exist."""
    if not path:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file or directory")
    return path
