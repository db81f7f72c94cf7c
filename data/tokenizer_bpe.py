"""Tokenizers on the `tokenizers` library, with Megatron-Core's meanings (what Megatron gets
from Hugging Face's AutoTokenizer on the same files; tests/test_tokenizer.py compares ids):

- GPT2BPETokenizer: vocab.json + merges.txt, eod `<|endoftext|>`, no added special ids;
- HuggingFaceTokenizer: a local tokenizer.json (or its folder); the tokenizer's own special
  tokens are added (e.g. Llama-3's begin-of-text) unless --tokenizer-hf-no-include-special-
  tokens; eod is the eos token (else the sep token); vocab_size counts added tokens;
- BertWordPieceLowerCase / BertWordPieceCase: a BERT vocab.txt; ids are [CLS] text [SEP],
  eod is [SEP] (Megatron-Core maps BERT's missing eos to sep); the cased type adds
  Megatron-Core's 100 `<extra_id_N>` special tokens.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence

from gigatron.data.tokenizer_base import Tokenizer, require_file

# well-known eos names, tried when the tokenizer's config names none (a bare tokenizer.json)
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


class _TokenizersLibrary(Tokenizer):
    """Encode/decode over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Any, eod_token: str, add_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._add_special = add_special_tokens
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise ValueError(f"{self.name}: end-of-document token {eod_token!r} is not in "
                             f"the vocabulary")
        self._eod = eod

    @property
    def backend(self) -> Any:
        """The `tokenizers.Tokenizer` that encodes (a Hugging Face export saves it as is)."""
        return self._tok

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


class GPT2BPETokenizer(_TokenizersLibrary):
    """GPT-2's byte-level BPE from `vocab.json` + `merges.txt`; eod is `<|endoftext|>`."""

    name = "GPT2BPETokenizer"
    EOD_TOKEN = "<|endoftext|>"

    def __init__(self, vocab_file: str, merge_file: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

        require_file(vocab_file, "--vocab-file", self.name)
        require_file(merge_file, "--merge-file", self.name)
        tok = HFTokenizer(models.BPE.from_file(vocab_file, merge_file))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        if tok.token_to_id(self.EOD_TOKEN) is None:
            raise ValueError(f"--vocab-file {vocab_file}: no {self.EOD_TOKEN} entry (GPT-2's "
                             f"end-of-document token); is this a GPT-2 vocab.json?")
        tok.add_special_tokens([self.EOD_TOKEN])  # one id, as in AutoTokenizer, when in text
        super().__init__(tok, self.EOD_TOKEN, add_special_tokens=True)


def _special_tokens(folder: Optional[str]) -> Dict[str, str]:
    """Special-token names from tokenizer_config.json, filled from special_tokens_map.json."""
    names: Dict[str, str] = {}
    for file in ("special_tokens_map.json", "tokenizer_config.json"):  # the config wins
        path = os.path.join(folder, file) if folder else None
        if not path or not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
        for key in ("eos_token", "sep_token"):
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                names[key] = value
    return names


def hf_eod_token(folder: Optional[str], tok: Any) -> str:
    """Megatron-Core's eod of a Hugging Face tokenizer: the eos token, else the sep token;
    for a bare tokenizer.json without a config, a well-known end-of-text name."""
    names = _special_tokens(folder)
    for key in ("eos_token", "sep_token"):
        if key in names and tok.token_to_id(names[key]) is not None:
            return names[key]
    for name in EOD_CANDIDATES:
        if tok.token_to_id(name) is not None:
            return name
    raise ValueError(f"HuggingFaceTokenizer: cannot tell the end-of-document token: no "
                     f"eos_token/sep_token in tokenizer_config.json and none of "
                     f"{EOD_CANDIDATES} in the vocab")


class HuggingFaceTokenizer(_TokenizersLibrary):
    """A local `tokenizer.json` (or a folder holding one), loaded with `tokenizers`."""

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str, include_special_tokens: bool = True) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        if path and not os.path.exists(path):
            raise ValueError(f"--tokenizer-model {path}: no such file or directory (local "
                             f"files only; for a Hugging Face Hub name: `huggingface-cli "
                             f"download {path} --local-dir DIR`, then pass DIR)")
        require_file(path, "--tokenizer-model", self.name)
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.exists(file):
            raise ValueError(f"--tokenizer-model {path}: folder has no tokenizer.json "
                             f"(a slow-only tokenizer: save it with a fast tokenizer first)")
        tok = HFTokenizer.from_file(file)
        super().__init__(tok, hf_eod_token(folder, tok), include_special_tokens)


BERT_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CASED_EXTRA_IDS = 100  # Megatron-Core gives BertWordPieceCase <extra_id_0..99>


class BertWordPieceTokenizer(_TokenizersLibrary):
    """BERT's WordPiece from a vocab.txt (lower-cased and accent-stripped, or cased)."""

    def __init__(self, vocab_file: str, lower_case: bool) -> None:
        from tokenizers import (Tokenizer as HFTokenizer, decoders, models, normalizers,
                                pre_tokenizers, processors)

        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        require_file(vocab_file, "--vocab-file", self.name)
        vocab = models.WordPiece.read_file(vocab_file)
        missing = [t for t in BERT_SPECIAL if t not in vocab]
        if missing:
            raise ValueError(f"--vocab-file {vocab_file}: no {', '.join(missing)} entries; "
                             f"is this a BERT vocab.txt?")
        tok = HFTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lower_case)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.post_processor = processors.BertProcessing(("[SEP]", vocab["[SEP]"]),
                                                       ("[CLS]", vocab["[CLS]"]))
        tok.decoder = decoders.WordPiece()
        tok.add_special_tokens(list(BERT_SPECIAL))
        if not lower_case:
            tok.add_special_tokens([f"<extra_id_{i}>" for i in range(CASED_EXTRA_IDS)])
        super().__init__(tok, "[SEP]", add_special_tokens=True)
