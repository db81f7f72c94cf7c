"""A run's tokenizer as Hugging Face tokenizer files, so that `AutoTokenizer.from_pretrained`
on an exported model folder gives the ids the model was trained on (tests compare them on a
corpus).

- SentencePiece models (the three Megatron names; BPE, unigram or char models): a
  `tokenizer.json` for the `tokenizers` library, built from the model's pieces and its
  normalizer settings, read from the .model file (a protobuf, parsed here: the protobuf
  package is not needed). No BOS is added and special-token text is not parsed, as the
  SentencePiece tokenizer of pretraining encodes.
- GPT2BPETokenizer and HuggingFaceTokenizer: the `tokenizers.Tokenizer` pretraining encodes
  with, saved as it is.
- Other types (TikTokenizer, BERT WordPiece, NullTokenizer) have no export: ValueError.

tokenizer_config.json names the generic fast tokenizer class, the special tokens, and turns
off the decode clean-up that would change the text.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Dict, Iterator, List, Optional, Tuple

from gigatron.data.tokenizer import Tokenizer
from gigatron.data.tokenizer_sentencepiece import SENTENCEPIECE_TYPES

EXPORTED_TYPES = SENTENCEPIECE_TYPES + ("GPT2BPETokenizer", "HuggingFaceTokenizer")
TOKENIZER_FILE, CONFIG_FILE = "tokenizer.json", "tokenizer_config.json"
SPIECE_UNDERLINE = "\u2581"
# SentencePiece's ModelProto: piece types and model types (sentencepiece_model.proto)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
_MODEL_TYPES = {1: "unigram", 2: "bpe", 3: "word", 4: "char"}
_NEVER = -1e9  # a unigram score no segmentation picks
UNKNOWN_SURFACE = " \u2047 "  # how SentencePiece decodes the unknown piece


def _varint(data: bytes, pos: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _fields(data: bytes) -> Iterator[Tuple[int, Any]]:
    """(field number, value) of a protobuf message: varints as int, the rest as bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        value: Any
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire == 2:
            size, pos = _varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = data[pos:pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield number, value


def read_sentencepiece_model(path: str) -> Dict[str, Any]:
    """What a tokenizer.json needs from a SentencePiece .model file: pieces (text, score,
    type), model type and normalizer settings (with SentencePiece's defaults)."""
    with open(path, "rb") as f:
        data = f.read()
    model: Dict[str, Any] = {"pieces": [], "model_type": "unigram", "charsmap": b"",
                             "add_dummy_prefix": True, "remove_extra_whitespaces": True,
                             "escape_whitespaces": True}
    for number, value in _fields(data):
        if number == 1:  # repeated SentencePiece {1: piece, 2: score, 3: type}
            piece = {1: b"", 2: b"\0\0\0\0", 3: _NORMAL, **dict(_fields(value))}
            model["pieces"].append((piece[1].decode("utf-8"), struct.unpack("<f", piece[2])[0],
                                    piece[3]))
        elif number == 2:  # TrainerSpec {3: model_type}
            model["model_type"] = _MODEL_TYPES.get(dict(_fields(value)).get(3, 1), "unknown")
        elif number == 3:  # NormalizerSpec
            spec = dict(_fields(value))
            model["charsmap"] = spec.get(2, b"")
            for field, name in ((3, "add_dummy_prefix"), (4, "remove_extra_whitespaces"),
                                (5, "escape_whitespaces")):
                model[name] = bool(spec.get(field, 1))
    return model


def _bpe_merges(pieces: List[Tuple[str, float, int]]) -> List[Tuple[str, str]]:
    """Merges that rebuild each normal piece from two normal pieces, the higher-scored
    (earlier learned) pieces first: SentencePiece's BPE applies the best-scored pair."""
    normal = {text: i for i, (text, _, kind) in enumerate(pieces) if kind == _NORMAL}
    merges = []
    for text, i in normal.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in normal and right in normal:
                merges.append((-pieces[i][1], i, normal[left], normal[right], left, right))
    return [(left, right) for *_, left, right in sorted(merges)]


def sentencepiece_to_tokenizers(path: str) -> Tuple[Any, Optional[str]]:
    """(a `tokenizers.Tokenizer` that encodes and decodes as the SentencePiece model does,
    the model's unknown piece)."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    spm = read_sentencepiece_model(path)
    pieces, kind = spm["pieces"], spm["model_type"]
    if kind not in ("bpe", "unigram", "char") or not spm["escape_whitespaces"]:
        raise ValueError(f"--tokenizer-model {path}: a SentencePiece {kind} model"
                         f"{'' if spm['escape_whitespaces'] else ' without whitespace escaping'}"
                         f" has no Hugging Face export (bpe, unigram and char models do)")
    unk = next((i for i, (_, _, t) in enumerate(pieces) if t == _UNKNOWN), None)
    byte_fallback = any(t == _BYTE for _, _, t in pieces)
    model: Any
    if kind == "unigram":  # control pieces never come out of text: no score can win
        model = models.Unigram([(text, score if t not in (_UNKNOWN, _CONTROL) else _NEVER)
                                for text, score, t in pieces], unk, byte_fallback)
    else:  # a char model is a BPE model without merges
        model = models.BPE({text: i for i, (text, _, _) in enumerate(pieces)},
                           _bpe_merges(pieces) if kind == "bpe" else [],
                           unk_token=None if unk is None else pieces[unk][0],
                           fuse_unk=True, byte_fallback=byte_fallback)
    tok = HFTokenizer(model)
    steps: List[Any] = [normalizers.Precompiled(spm["charsmap"])] if spm["charsmap"] else []
    if spm["remove_extra_whitespaces"]:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if spm["add_dummy_prefix"]:
        steps.append(normalizers.Prepend(SPIECE_UNDERLINE))
    tok.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPIECE_UNDERLINE)])
    # the unknown piece is replaced while the tokens are apart (a "<unk>" in text is several)
    tok.decoder = decoders.Sequence(
        ([decoders.Replace(pieces[unk][0], UNKNOWN_SURFACE)] if unk is not None else [])
        + [decoders.Replace(SPIECE_UNDERLINE, " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if spm["add_dummy_prefix"] else []))
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False)
                            for text, _, t in pieces if t in (_UNKNOWN, _CONTROL)])
    tok.add_tokens([AddedToken(text, normalized=False)
                    for text, _, t in pieces if t == _USER_DEFINED])
    return tok, None if unk is None else pieces[unk][0]


def _token(tok: Any, token_id: Optional[int]) -> Optional[str]:
    return None if token_id is None or token_id < 0 else tok.id_to_token(token_id)


def write_hf_tokenizer(tokenizer: Tokenizer, tokenizer_type: str, model_file: Optional[str],
                       out_dir: str, max_length: int) -> Dict[str, Optional[int]]:
    """Write tokenizer.json and tokenizer_config.json for `tokenizer` (built by pretraining
    from `tokenizer_type` and `model_file`) in `out_dir`; returns its bos/eos ids for the
    model's config.json (None: the tokenizer has no such token)."""
    if tokenizer_type not in EXPORTED_TYPES:
        raise ValueError(f"--tokenizer-type {tokenizer_type} has no Hugging Face tokenizer "
                         f"export (exported: {', '.join(EXPORTED_TYPES)})")
    sentencepiece = tokenizer_type in SENTENCEPIECE_TYPES
    tok, unk = sentencepiece_to_tokenizers(str(model_file)) if sentencepiece else \
        (getattr(tokenizer, "backend"), None)
    bos = getattr(tokenizer, "bos", None) if sentencepiece else None
    if tokenizer_type == "GPT2BPETokenizer":
        # GPT-2's <|endoftext|> is its bos, eos and unk
        bos, unk = tokenizer.eod, tok.id_to_token(tokenizer.eod)
    config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
        "clean_up_tokenization_spaces": False, "eos_token": _token(tok, tokenizer.eod),
        "bos_token": _token(tok, bos), "add_bos_token": False, "add_eos_token": False,
        # pretraining's SentencePiece tokenizer reads "</s>" in text as text
        "split_special_tokens": sentencepiece, "unk_token": unk}
    if tokenizer_type == "HuggingFaceTokenizer":  # --sft's chat template goes along
        config["chat_template"] = read_chat_template(str(model_file))
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, TOKENIZER_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump({k: v for k, v in config.items() if v is not None}, f, indent=2,
                  sort_keys=True)
        f.write("\n")
    return {"bos_token_id": None if bos is None or bos < 0 else bos,
            "eos_token_id": tokenizer.eod}


def read_chat_template(tokenizer_model: str) -> Optional[str]:
    """The chat template of a Hugging Face tokenizer folder (or a tokenizer.json's folder):
    chat_template.jinja, else tokenizer_config.json's (a string; None when it has none)."""
    folder = tokenizer_model if os.path.isdir(tokenizer_model) else \
        os.path.dirname(os.path.abspath(tokenizer_model))
    path = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(folder, CONFIG_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            template = json.load(f).get("chat_template")
        return template if isinstance(template, str) else None
    return None
