"""Megatron's TikTokenizer: a tiktoken BPE read from Megatron's JSON vocabulary (a list of
{"rank", "token_bytes" (base64), "token_str"}), with Megatron-Core's layout of ids:

ids 0..num_special_tokens-1 are special tokens (the --tokenizer-special-tokens, default
<unk> <s> </s> <mask> <pad> <cls> <sep>, then <SPECIAL_N> fillers), the BPE ranks follow,
cut so that the whole vocabulary is --vocab-size (default 131072); eod is </s>. Special
tokens written in the text become their ids (tiktoken's allowed_special="all"), as in
Megatron-Core. Needs the `tiktoken` package.
"""
from __future__ import annotations

import base64
import json
import os
from typing import Dict, List, Optional, Sequence

from gigatron.data.tokenizer_base import Tokenizer, require_file

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
           r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
           r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
DEFAULT_PATTERN = "v2"
DEFAULT_VOCAB_SIZE = 2 ** 17
DEFAULT_NUM_SPECIAL_TOKENS = 1000
REQUIRED_SPECIAL = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")


def read_ranks(path: str, keep: int, offset: int) -> Dict[bytes, int]:
    """token bytes -> id of the first `keep` entries of Megatron's JSON vocabulary, shifted
    by `offset` (the special tokens come first)."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--tokenizer-model {path}: not a readable JSON vocabulary ({err})")
    if not isinstance(entries, list):
        raise ValueError(f"--tokenizer-model {path}: expected a JSON list of {{rank, "
                         f"token_bytes, token_str}} (Megatron's TikTokenizer vocabulary)")
    ranks: Dict[bytes, int] = {}
    for i, entry in enumerate(entries[:keep]):
        if not isinstance(entry, dict) or set(entry) != {"rank", "token_bytes", "token_str"} \
                or entry["rank"] != i:
            raise ValueError(f"--tokenizer-model {path}: entry {i} is not {{\"rank\": {i}, "
                             f"\"token_bytes\", \"token_str\"}}")
        token = base64.b64decode(entry["token_bytes"])
        if i < 256 and token != bytes([i]):
            raise ValueError(f"--tokenizer-model {path}: entry {i} must be the single byte {i}")
        ranks[token] = i + offset
    if len(ranks) < keep:
        raise ValueError(f"--tokenizer-model {path} holds {len(ranks)} tokens, but --vocab-size "
                         f"minus --tiktoken-num-special-tokens asks for {keep}: lower "
                         f"--vocab-size to {len(ranks) + offset}")
    return ranks


def special_token_list(special_tokens: Optional[Sequence[str]], num_special: int,
                       vocab_size: int) -> List[str]:
    """The special tokens at ids 0..num_special-1 (given ones, then <SPECIAL_N> fillers)."""
    names = list(special_tokens) if special_tokens else list(REQUIRED_SPECIAL)
    missing = [t for t in REQUIRED_SPECIAL if t not in names]
    if missing or len(set(names)) != len(names):
        raise ValueError(f"--tokenizer-special-tokens must be distinct and include "
                         f"{' '.join(REQUIRED_SPECIAL)} (missing: {' '.join(missing) or 'none'})")
    if not len(names) <= num_special < vocab_size:
        raise ValueError(f"--tiktoken-num-special-tokens {num_special} must be at least the "
                         f"{len(names)} special tokens and below --vocab-size {vocab_size}")
    return names + [f"<SPECIAL_{i}>" for i in range(len(names), num_special)]


class TikTokenizer(Tokenizer):
    """Megatron-Core's TikTokenizer over the `tiktoken` package."""

    name = "TikTokenizer"

    def __init__(self, path: str, pattern: Optional[str] = None, vocab_size: Optional[int] = None,
                 num_special_tokens: int = DEFAULT_NUM_SPECIAL_TOKENS,
                 special_tokens: Optional[Sequence[str]] = None) -> None:
        try:
            import tiktoken
        except ImportError:
            raise ValueError("--tokenizer-type TikTokenizer needs the tiktoken package: "
                             "pip install tiktoken") from None
        require_file(path, "--tokenizer-model", self.name)
        pattern = pattern or DEFAULT_PATTERN
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern {pattern!r}: choose v1 or v2")
        self._vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        specials = special_token_list(special_tokens, num_special_tokens, self._vocab_size)
        ranks = read_ranks(path, self._vocab_size - num_special_tokens, num_special_tokens)
        self._encoding = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))),
            pat_str=PATTERNS[pattern], mergeable_ranks=ranks,
            special_tokens={t: i for i, t in enumerate(specials)})
        self._eod = specials.index("</s>")

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    def tokenize(self, text: str) -> List[int]:
        return self._encoding.encode(text, allowed_special="all")

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._encoding.encode_batch(list(texts), num_threads=1, allowed_special="all")

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._encoding.decode([int(i) for i in ids])
