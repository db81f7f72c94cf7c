"""Every Megatron --tokenizer-type gives the ids, eod and vocab_size Megatron-Core gets from
the same files: Megatron-Core builds GPT-2 BPE, Hugging Face and BERT tokenizers with
transformers' AutoTokenizer, so those are compared id for id with transformers on tokenizers
trained here; TikTokenizer against a plain-Python byte-pair merge by rank (tiktoken's
algorithm); the SentencePiece names and NullTokenizer against Megatron-Core's definitions."""
import base64
import json
import os
import re

import pytest

from gigatron.data.sentencepiece_trainer import list_text_files
from gigatron.data.tokenizer import (DEFAULT_TOKENIZER_TYPE, TOKENIZER_TYPES, NullTokenizer,
                                     build_tokenizer, tokenizer_type_to_build)

STDLIB = os.path.dirname(os.__file__)
# the rest of a valid pretrain_gpt.py command line (model and loop)
MODEL_AND_LOOP = ("--num-layers 1 --hidden-size 8 --num-attention-heads 2 --seq-length 8 "
                  "--micro-batch-size 1 --train-iters 1 --lr 1").split()
CORPUS = list_text_files([os.path.join(STDLIB, d) for d in ("json", "email", "http")], [".py"])
UNSEEN = "Grüße, 東京! naïve café — ünïcödé 🙂\t  indented\n\n\ttabs  and  spaces\r\n"
TEXTS = [open(os.path.join(STDLIB, "textwrap.py"), encoding="utf-8").read()[:6000], UNSEEN,
         "Hello world.<|endoftext|>Next document</s> ends", "", "  leading spaces",
         "UPPER lower MiXeD 12345 3.14 e-mail@example.com [CLS] ##ing"]


@pytest.fixture(scope="module")
def bpe_folder(tmp_path_factory):
    """A byte-level BPE (GPT-2 style) trained here: vocab.json, merges.txt, tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(CORPUS, trainer)
    tok.model.save(str(folder))
    tok.save(str(folder / "tokenizer.json"))
    return folder


def _hf_folder(root, name, config, bos_template=False):
    """A Hugging Face tokenizer folder from the trained BPE, with its tokenizer_config.json."""
    from tokenizers import Tokenizer, processors

    folder = root / name
    folder.mkdir()
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    if bos_template:  # Llama-style: the tokenizer adds <s> in front of every text
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **config}  # AutoTokenizer's class
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def test_gpt2_bpe_ids_equal_transformers_gpt2_tokenizer_fast(bpe_folder):
    import shutil

    from transformers import GPT2TokenizerFast

    files = bpe_folder / "gpt2_files"  # only the two files Megatron is given
    files.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(bpe_folder / name, files / name)
    vocab, merges = str(files / "vocab.json"), str(files / "merges.txt")
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    theirs = GPT2TokenizerFast.from_pretrained(str(files))
    for text in TEXTS:
        assert ours.tokenize(text) == theirs(text).input_ids, text[:60]
        assert ours.detokenize(ours.tokenize(text)) == text
    assert (ours.vocab_size, ours.eod) == (len(theirs), theirs.eos_token_id) == (700, 0)


@pytest.mark.parametrize("bos", [False, True])
def test_huggingface_tokenizer_equals_autotokenizer_with_and_without_special_tokens(
        bpe_folder, bos):
    from transformers import AutoTokenizer

    folder = _hf_folder(bpe_folder, f"hf_bos{bos}", {"eos_token": "</s>", "bos_token": "<s>"},
                        bos_template=bos)
    theirs = AutoTokenizer.from_pretrained(folder)
    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder)
    plain = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder,
                            tokenizer_hf_no_include_special_tokens=True)
    for text in TEXTS:
        assert ours.tokenize(text) == theirs(text).input_ids, text[:60]
        assert plain.tokenize(text) == theirs(text, add_special_tokens=False).input_ids
    assert ours.tokenize_batch(TEXTS) == [ours.tokenize(t) for t in TEXTS]
    assert (ours.vocab_size, ours.eod) == (len(theirs), theirs.eos_token_id)
    assert ours.tokenize("x")[:1] == ([theirs.bos_token_id] if bos else ours.tokenize("x")[:1])


def test_huggingface_eod_falls_back_to_sep_as_megatron_core_and_names_missing_folders(
        bpe_folder, tmp_path):
    folder = _hf_folder(bpe_folder, "hf_sep", {"sep_token": "<s>"})
    assert build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder).eod == 1
    with pytest.raises(ValueError, match=r"meta-llama/Llama-2-7b: no such file .*"
                                         r"huggingface-cli download"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model="meta-llama/Llama-2-7b")


@pytest.fixture(scope="module")
def bert_vocab(tmp_path_factory):
    """A BERT vocab.txt (WordPiece, with [PAD] [UNK] [CLS] [SEP] [MASK]) trained here."""
    from tokenizers import BertWordPieceTokenizer

    folder = tmp_path_factory.mktemp("bert")
    tok = BertWordPieceTokenizer(lowercase=False)
    tok.train(CORPUS, vocab_size=900, show_progress=False)
    tok.save_model(str(folder))
    return str(folder / "vocab.txt")


@pytest.mark.parametrize("lower", [True, False])
def test_bert_wordpiece_types_equal_transformers_bert_tokenizer_fast(bert_vocab, lower):
    from transformers import BertTokenizerFast

    name = "BertWordPieceLowerCase" if lower else "BertWordPieceCase"
    ours = build_tokenizer(name, vocab_file=bert_vocab)
    # Megatron-Core: AutoTokenizer of bert-large-(un)cased over --vocab-file; the cased type
    # also gets 100 <extra_id_N> special tokens
    extra = [] if lower else [f"<extra_id_{i}>" for i in range(100)]
    theirs = BertTokenizerFast.from_pretrained(os.path.dirname(bert_vocab),
                                               do_lower_case=lower,
                                               additional_special_tokens=extra)
    for text in TEXTS + ["sentinel <extra_id_7> here"]:
        assert ours.tokenize(text) == theirs(text).input_ids, text[:60]
    assert (ours.vocab_size, ours.eod) == (len(theirs), theirs.sep_token_id)
    assert ours.vocab_size == 900 + len(extra)


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    from gigatron.data.sentencepiece_trainer import train_sentencepiece

    prefix = str(tmp_path_factory.mktemp("spm") / "spm")
    return train_sentencepiece([os.path.join(STDLIB, "json")], prefix, vocab_size=400,
                               input_sentence_size=5000, max_bytes=400_000, suffixes=[".py"])


def test_the_three_sentencepiece_names_are_megatron_cores_one_tokenizer(sentencepiece_model):
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)
    for name in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = build_tokenizer(name, tokenizer_model=sentencepiece_model)
        assert (tok.vocab_size, tok.eod, tok.name) == (sp.get_piece_size(), sp.eos_id(), name)
        for text in TEXTS:  # encode_as_ids: no BOS in front, no pieces added
            assert tok.tokenize(text) == sp.encode_as_ids(text)


def test_null_tokenizer_vocab_is_exactly_vocab_size_and_default_type_is_megatrons():
    tok = build_tokenizer("NullTokenizer", vocab_size=128256)
    assert (tok.vocab_size, tok.eod) == (128256, 128255)
    assert build_tokenizer("NullTokenizer", vocab_size=10, null_tokenizer_eod_id=3).eod == 3
    assert DEFAULT_TOKENIZER_TYPE == "GPT2BPETokenizer"
    assert tokenizer_type_to_build({"data_path": ["x"]}) == "GPT2BPETokenizer"
    assert tokenizer_type_to_build({"mock_data": True, "vocab_size": 100}) is None
    assert tokenizer_type_to_build({"mock_data": True, "vocab_file": "v.json"}) == \
        "GPT2BPETokenizer"
    assert set(TOKENIZER_TYPES) == {
        "BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
        "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
        "Llama2Tokenizer", "TikTokenizer", "NullTokenizer"}
    with pytest.raises(ValueError, match="MultimodalTokenizer is not supported: multimodal"):
        build_tokenizer("MultimodalTokenizer")


def test_validation_names_the_default_tokenizer_type_and_its_files(tmp_path):
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.validation import ConfigError

    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"")
    argv = ["--data-path", str(tmp_path / "d")] + MODEL_AND_LOOP
    with pytest.raises(ConfigError) as err:
        parse_args(argv, 1)
    # the tokenizer's own line, not also the unknown vocabulary that follows from it
    assert err.value.problems == ["--tokenizer-type GPT2BPETokenizer (Megatron's default when "
                                  "--tokenizer-type is not given) needs --vocab-file, "
                                  "--merge-file"]


# ---- TikTokenizer ----------------------------------------------------------------------

def _gpt2_bytes():
    """GPT-2's byte <-> printable character table (the ByteLevel alphabet)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@pytest.fixture(scope="module")
def tiktoken_vocab(bpe_folder):
    """Megatron's TikTokenizer JSON (rank, token_bytes, token_str) from the trained BPE's
    merges: the 256 bytes, then each merge's bytes in merge order."""
    table = _gpt2_bytes()
    to_bytes = lambda piece: bytes(table[c] for c in piece)  # noqa: E731
    ranks = [bytes([b]) for b in range(256)]
    seen = set(ranks)
    for line in open(bpe_folder / "merges.txt", encoding="utf-8").read().splitlines()[1:]:
        a, b = line.split(" ")
        token = to_bytes(a) + to_bytes(b)
        if token not in seen:
            seen.add(token)
            ranks.append(token)
    path = bpe_folder / "tiktoken.json"
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("utf-8", errors="replace")}
                                for i, t in enumerate(ranks)]))
    return str(path), ranks


def _merge_by_rank(piece: bytes, rank):
    """tiktoken's byte-pair encoding of one piece: merge the lowest-ranked adjacent pair."""
    parts = [piece[i:i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        pairs = [(rank.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
        best = min((r, i) for r, i in pairs if r is not None) if any(
            r is not None for r, _ in pairs) else None
        if best is None:
            break
        i = best[1]
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [rank[p] for p in parts]


def test_tiktokenizer_ids_are_tiktokens_bpe_after_the_special_tokens(tiktoken_vocab):
    pytest.importorskip("tiktoken")
    import regex

    from gigatron.data.tokenizer_tiktoken import PATTERNS

    path, ranks = tiktoken_vocab
    tok = build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=1500,
                          tiktoken_num_special_tokens=1000)
    kept = {t: i + 1000 for i, t in enumerate(ranks[:500])}  # vocab 1500 - 1000 specials
    assert (tok.vocab_size, tok.eod) == (1500, 2)
    for text in TEXTS[:2] + ["plain words and numbers 12345"]:
        expected = [i for piece in regex.findall(PATTERNS["v2"], text)
                    for i in _merge_by_rank(piece.encode("utf-8"), kept)]
        assert tok.tokenize(text) == expected
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.tokenize("a</s>") == tok.tokenize("a") + [2]  # special tokens in text: ids


def test_tiktokenizer_errors_name_the_flag_and_the_fix(tiktoken_vocab):
    pytest.importorskip("tiktoken")
    path, _ = tiktoken_vocab
    with pytest.raises(ValueError, match=r"holds \d+ tokens, but --vocab-size minus "
                                         r"--tiktoken-num-special-tokens asks for"):
        build_tokenizer("TikTokenizer", tokenizer_model=path)  # default vocab 131072
    with pytest.raises(ValueError, match="--tokenizer-special-tokens must be distinct and "
                                         "include"):
        build_tokenizer("TikTokenizer", tokenizer_model=path, vocab_size=1500,
                        tokenizer_special_tokens=["<unk>", "<s>"])


def test_tiktokenizer_without_tiktoken_says_how_to_install_it(tiktoken_vocab, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tiktoken", None)  # as if not installed
    with pytest.raises(ValueError, match="needs the tiktoken package: pip install tiktoken"):
        build_tokenizer("TikTokenizer", tokenizer_model=tiktoken_vocab[0])


def test_preprocess_writes_bert_wordpiece_documents(bert_vocab, tmp_path):
    from gigatron.data.indexed_dataset import IndexedDataset
    from gigatron.data.preprocess import main

    data = tmp_path / "docs.jsonl"
    data.write_text('{"text": "Hello World"}\n{"text": "second one"}\n')
    out = str(tmp_path / "bert")
    assert main(["--input", str(data), "--output-prefix", out, "--tokenizer-type",
                 "BertWordPieceLowerCase", "--vocab-file", bert_vocab, "--append-eod"]) == 0
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=bert_vocab)
    ds = IndexedDataset(out + "_text_document")
    assert [ds.get(i).tolist() for i in range(len(ds))] == [
        tok.tokenize("Hello World") + [tok.eod], tok.tokenize("second one") + [tok.eod]]


def test_a_wrong_data_path_or_misspelled_flag_does_not_lose_the_tokenizers_vocabulary(
        sentencepiece_model, tmp_path):
    """Issue 26 section 6: with a correct tokenizer, each mistake is reported alone, never
    with a false "the vocabulary size is unknown" next to it."""
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.validation import ConfigError

    tokenizer = ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
                 sentencepiece_model]
    (tmp_path / "d.bin").write_bytes(b"")
    (tmp_path / "d.idx").write_bytes(b"")
    good_data = ["--data-path", str(tmp_path / "d")]
    assert parse_args(tokenizer + good_data + MODEL_AND_LOOP, 1).model.vocab_size == 400
    for mistake, line in (
            (["--data-path", str(tmp_path / "nope")], r"--data-path .*nope\.idx does not exist"),
            (good_data + ["--global-batch-sise", "8"], r"unknown flag\(s\) --global-batch-sise 8; "
                                                       r"did you mean --global-batch-size\?")):
        with pytest.raises(ConfigError) as err:
            parse_args(tokenizer + mistake + MODEL_AND_LOOP, 1)
        assert len(err.value.problems) == 1 and re.search(line, err.value.problems[0]), \
            err.value.problems


def test_null_tokenizer_for_mock_data_keeps_the_vocab_size():
    from gigatron.training.config.arguments import build_run, read_settings

    def tokenizer(argv):
        return build_run(read_settings(argv + MODEL_AND_LOOP, 1), 1)[1]

    tok = tokenizer(["--mock-data", "--vocab-size", "100"])
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod) == (100, 99)
    assert tokenizer(["--mock-data", "--model", "gpt2-124m"]).vocab_size == 50257
