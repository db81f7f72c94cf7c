"""Tokenizers under Megatron's `--tokenizer-type` names, with Megatron-Core's meanings (ids,
eod, vocab_size); `build_tokenizer` builds one from its type and files.

The implementations: GPT-2 BPE, Hugging Face and BERT WordPiece on the `tokenizers` library
(`tokenizer_bpe.py`), the SentencePiece family (`tokenizer_sentencepiece.py`), TikTokenizer on
`tiktoken` (`tokenizer_tiktoken.py`), NullTokenizer here. When --tokenizer-type is not given,
pretrain_gpt.py uses Megatron's default, GPT2BPETokenizer (`DEFAULT_TOKENIZER_TYPE`).
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar

from gigatron.data.tokenizer_base import Tokenizer, require_file
from gigatron.data.tokenizer_bpe import (BertWordPieceTokenizer, GPT2BPETokenizer,
                                         HuggingFaceTokenizer)
from gigatron.data.tokenizer_sentencepiece import SENTENCEPIECE_TYPES, SentencePieceTokenizer
from gigatron.data.tokenizer_tiktoken import TikTokenizer

T = TypeVar("T")

# every type and the flags (argparse dests) it needs; Megatron's order
TOKENIZER_NEEDS: Dict[str, Tuple[str, ...]] = {
    "BertWordPieceLowerCase": ("vocab_file",),
    "BertWordPieceCase": ("vocab_file",),
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}
TOKENIZER_TYPES = tuple(TOKENIZER_NEEDS)
DEFAULT_TOKENIZER_TYPE = "GPT2BPETokenizer"  # Megatron's pretrain_gpt.py default
NOT_SUPPORTED = {  # Megatron's other types, and why they are not here
    "MultimodalTokenizer": "multimodal (vision-language) models are not part of gigatron",
    "NullMultimodalTokenizer": "multimodal (vision-language) models are not part of gigatron",
    "SFTTokenizer": "its prompt formats are not used: --sft takes HuggingFaceTokenizer and "
                    "its own chat template (docs/SFT.md)",
}
__all__ = ["Tokenizer", "NullTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer",
           "BertWordPieceTokenizer", "SentencePieceTokenizer", "TikTokenizer",
           "TOKENIZER_TYPES", "TOKENIZER_NEEDS", "DEFAULT_TOKENIZER_TYPE", "build_tokenizer",
           "tokenizer_from_flags", "tokenizer_type_to_build", "missing_tokenizer_flags",
           "require_file"]


class NullTokenizer(Tokenizer):
    """Text is space-separated token ids. As Megatron-Core's: vocab_size is --vocab-size
    exactly and eod its last id (or --null-tokenizer-eod-id)."""

    name = "NullTokenizer"

    def __init__(self, vocab_size: int, eod_id: Optional[int] = None) -> None:
        if vocab_size is None or int(vocab_size) <= 0:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size > 0")
        self._vocab_size = int(vocab_size)
        self._eod = self._vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self._eod < self._vocab_size:
            raise ValueError(f"--null-tokenizer-eod-id {eod_id} must be in [0, "
                             f"{self._vocab_size}) (--vocab-size {self._vocab_size})")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError as err:
            raise ValueError(f"NullTokenizer: text must be space-separated integers ({err})")
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: ids {bad[:5]} outside [0, {self._vocab_size}) "
                             f"(--vocab-size {self._vocab_size})")
        return ids

    def detokenize(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)


def build_tokenizer(tokenizer_type: str, *, tokenizer_model: Optional[str] = None,
                    vocab_file: Optional[str] = None, merge_file: Optional[str] = None,
                    vocab_size: Optional[int] = None, null_tokenizer_eod_id: Optional[int] = None,
                    tiktoken_pattern: Optional[str] = None,
                    tiktoken_num_special_tokens: int = 1000,
                    tokenizer_special_tokens: Optional[Sequence[str]] = None,
                    tokenizer_hf_no_include_special_tokens: bool = False) -> Tokenizer:
    """The tokenizer Megatron's `--tokenizer-type` and its flags (keyword = flag dest)
    describe."""
    t = tokenizer_type
    if t in NOT_SUPPORTED:
        raise ValueError(f"--tokenizer-type {t} is not supported: {NOT_SUPPORTED[t]}")
    if t not in TOKENIZER_NEEDS:
        raise ValueError(f"--tokenizer-type {t!r} is not supported; choose one of "
                         f"{', '.join(TOKENIZER_TYPES)}")
    if t.startswith("BertWordPiece"):
        return BertWordPieceTokenizer(_needs(t, "--vocab-file", vocab_file),
                                      lower_case=t == "BertWordPieceLowerCase")
    if t == "GPT2BPETokenizer":
        return GPT2BPETokenizer(_needs(t, "--vocab-file", vocab_file),
                                _needs(t, "--merge-file", merge_file))
    if t == "NullTokenizer":
        return NullTokenizer(_needs(t, "--vocab-size", vocab_size), null_tokenizer_eod_id)
    model = _needs(t, "--tokenizer-model", tokenizer_model)
    if t in SENTENCEPIECE_TYPES:
        return SentencePieceTokenizer(model, name=t)
    if t == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(model, not tokenizer_hf_no_include_special_tokens)
    return TikTokenizer(model, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens,
                        tokenizer_special_tokens)


TOKENIZER_FLAGS = ("tokenizer_model", "vocab_file", "merge_file", "vocab_size",
                   "null_tokenizer_eod_id", "tiktoken_pattern", "tiktoken_num_special_tokens",
                   "tokenizer_special_tokens", "tokenizer_hf_no_include_special_tokens")


def tokenizer_from_flags(flags: Mapping[str, Any],
                         tokenizer_type: Optional[str] = None) -> Tokenizer:
    """build_tokenizer from parsed flags (argparse dests; a flag a parser lacks keeps its
    default); `tokenizer_type` defaults to flags["tokenizer_type"]."""
    options = {k: flags[k] for k in TOKENIZER_FLAGS if flags.get(k) is not None}
    return build_tokenizer(tokenizer_type or flags["tokenizer_type"], **options)


def tokenizer_type_to_build(flags: Mapping[str, Any]) -> Optional[str]:
    """--tokenizer-type, or Megatron's default (GPT2BPETokenizer) when it is not given; None
    for --mock-data without GPT-2 files (the caller builds a NullTokenizer of the model's
    vocabulary: Megatron would download GPT-2's files here, gigatron downloads nothing)."""
    if flags.get("tokenizer_type"):
        return str(flags["tokenizer_type"])
    if flags.get("mock_data") and not (flags.get("vocab_file") or flags.get("merge_file")):
        return None
    return DEFAULT_TOKENIZER_TYPE


def missing_tokenizer_flags(flags: Mapping[str, Any]) -> Tuple[Optional[str], List[str]]:
    """(the type tokenizer_type_to_build picks, the flag dests it needs that are not given)."""
    tokenizer_type = tokenizer_type_to_build(flags)
    if tokenizer_type is None or tokenizer_type not in TOKENIZER_NEEDS:
        return tokenizer_type, []
    return tokenizer_type, [d for d in TOKENIZER_NEEDS[tokenizer_type] if flags.get(d) is None]


def _needs(tokenizer_type: str, flag: str, value: Optional[T]) -> T:
    """`value`, or a one-line error naming the flag this tokenizer type needs."""
    if value is None:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")
    return value
