"""Tokenizers under Megatron's `--tokenizer-type` names, each with eod, vocab_size and
tokenize/detokenize. BPE and HuggingFace tokenizers run on the `tokenizers` library,
SentencePiece on `sentencepiece`."""
from __future__ import annotations

import abc
import json
import os
from typing import List, Optional, Sequence, TypeVar

T = TypeVar("T")

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
                   "NullTokenizer")


class Tokenizer(abc.ABC):
    """The interface preprocessing and training rely on."""

    name = "abstract"

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must cover."""

    @property
    @abc.abstractmethod
    def eod(self) -> int:
        """The end-of-document id appended by --append-eod."""

    @abc.abstractmethod
    def tokenize(self, text: str) -> List[int]:
        """Text to ids."""

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(t) for t in texts]

    @abc.abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Ids back to text."""


def _require_file(path: Optional[str], flag: str, tokenizer_type: str) -> str:
    if not path:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    if not os.path.exists(path):
        raise ValueError(f"{flag} {path}: no such file or directory")
    return path


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model; eod is the model's end-of-sentence id."""

    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str) -> None:
        import sentencepiece

        _require_file(model_file, "--tokenizer-model", self.name)
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


class _HFTokenizerBase(Tokenizer):
    """Shared encode/decode over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer, eod_token: str, add_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._add_special = add_special_tokens
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"{self.name}: end-of-document token {eod_token!r} is not in "
                             f"the vocabulary")
        self._eod = eod

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=self._add_special).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=self._add_special)
        return [e.ids for e in encodings]

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_HFTokenizerBase):
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`; eod is `<|endoftext|>`."""

    name = "GPT2BPETokenizer"
    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        _require_file(vocab_file, "--vocab-file", self.name)
        _require_file(merge_file, "--merge-file", self.name)
        tok = HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(self.EOD_TOKEN) is not None:
            tok.add_special_tokens([self.EOD_TOKEN])  # never split it when it appears in text
        super().__init__(tok, self.EOD_TOKEN)


EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


def _hf_eod_token(folder: Optional[str], tok) -> str:
    """The eos token from tokenizer_config.json when present, else a well-known name."""
    config = os.path.join(folder, "tokenizer_config.json") if folder else None
    if config and os.path.exists(config):
        with open(config, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if eos and tok.token_to_id(eos) is not None:
            return eos
    for name in EOD_CANDIDATES:
        if tok.token_to_id(name) is not None:
            return name
    raise ValueError(f"HuggingFaceTokenizer: cannot tell the end-of-document token: no "
                     f"tokenizer_config.json eos_token and none of {EOD_CANDIDATES} in the vocab")


class HuggingFaceTokenizer(_HFTokenizerBase):
    """A local `tokenizer.json` (or a folder holding one), loaded with `tokenizers`."""

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str, add_special_tokens: bool = False) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        _require_file(path, "--tokenizer-model", self.name)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise ValueError(f"--tokenizer-model {path}: folder has no tokenizer.json "
                             f"(only local files are supported, no hub download)")
        tok = HFTokenizer.from_file(file)
        super().__init__(tok, _hf_eod_token(folder, tok), add_special_tokens)


class NullTokenizer(Tokenizer):
    """Text is space-separated token ids; eod is `vocab_size` (so the vocabulary is one more)."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size > 0")
        self._base = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._base + 1

    @property
    def eod(self) -> int:
        return self._base

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as err:
            raise ValueError(f"NullTokenizer: text must be space-separated integers ({err})")
        bad = [i for i in ids if not 0 <= i <= self._base]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} outside [0, {self._base}]")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, *, tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer Megatron's `--tokenizer-type` and its file flags describe."""
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(_needs(tokenizer_type, "--tokenizer-model", tokenizer_model))
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_needs(tokenizer_type, "--vocab-file", vocab_file),
                                _needs(tokenizer_type, "--merge-file", merge_file))
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(_needs(tokenizer_type, "--tokenizer-model", tokenizer_model))
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(_needs(tokenizer_type, "--vocab-size", vocab_size))
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not supported; choose one of "
                     f"{', '.join(TOKENIZER_TYPES)}")


def _needs(tokenizer_type: str, flag: str, value: Optional[T]) -> T:
    """`value`, or a one-line error naming the flag this tokenizer type needs."""
    if value is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    return value
