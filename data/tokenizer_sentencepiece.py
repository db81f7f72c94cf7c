"""SentencePiece tokenizers under Megatron's three names, with Megatron-Core's meaning: since
Megatron-Core's tokenizer library (the default from late 2025; the legacy classes were removed
in February 2026), SentencePieceTokenizer, GPTSentencePieceTokenizer and Llama2Tokenizer are
one tokenizer: ids are the model's pieces (no BOS added), eod is the model's eos piece and
vocab_size its piece count.

Legacy Megatron (and Megatron-DeepSpeed) differ: their SentencePieceTokenizer appended
<CLS>/<SEP>/<EOD>/<MASK> pieces (eod = <EOD>) and their Llama2Tokenizer prepended BOS to
every document; data preprocessed that way still trains here (its ids are ids), but a fresh
preprocessing follows Megatron-Core.
"""
from __future__ import annotations

from typing import List, Sequence

from gigatron.data.tokenizer_base import Tokenizer, require_file

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; eod is the model's end-of-sentence id."""

    def __init__(self, model_file: str, name: str = "SentencePieceTokenizer") -> None:
        import sentencepiece

        self.name = name
        require_file(model_file, "--tokenizer-model", self.name)
        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        if self._sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_file}: the model has no eos piece to "
                             f"use as end-of-document; train it with eos_id >= 0")

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    def tokenize(self, text: str) -> List[int]:
        return self._sp.encode(text)

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), num_threads=1)  # parallelism: preprocess --workers

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])
