"""Each --tokenizer-type round-trips real text; SentencePiece trains on a real local corpus."""
import json
import os

import pytest

from gigatron.data.sentencepiece_trainer import list_text_files
from gigatron.data.tokenizer import (GPT2BPETokenizer, HuggingFaceTokenizer, NullTokenizer,
                                         SentencePieceTokenizer, build_tokenizer)

STDLIB = os.path.dirname(os.__file__)
CORPUS_DIRS = [os.path.join(STDLIB, d) for d in ("json", "email", "http", "logging")]
UNSEEN = "Grüße, 東京! naïve café — ünïcödé 🙂\t  indented\n\n\ttabs  and  spaces\r\n"


@pytest.fixture(scope="module")
def real_text():
    """Text not used for training: two standard-library modules plus unusual characters."""
    parts = [open(os.path.join(STDLIB, name), encoding="utf-8").read()
             for name in ("textwrap.py", "argparse.py")]
    return "\n".join(parts) + UNSEEN


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    from gigatron.data.sentencepiece_trainer import train_sentencepiece

    prefix = str(tmp_path_factory.mktemp("spm") / "spm")
    return train_sentencepiece(CORPUS_DIRS, prefix, vocab_size=600, input_sentence_size=20000,
                               max_bytes=1_500_000, suffixes=[".py"])


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    """A small byte-level BPE (GPT-2 style) trained with the `tokenizers` trainer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    files = list_text_files(CORPUS_DIRS, [".py"])
    tok.train(files, trainer)
    vocab, merges = tok.model.save(str(folder))
    tok.save(str(folder / "tokenizer.json"))
    with open(folder / "tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)
    return str(folder), vocab, merges


def test_sentencepiece_trained_on_stdlib_round_trips_real_text(sentencepiece_model, real_text):
    tok = SentencePieceTokenizer(sentencepiece_model)
    assert tok.vocab_size == 600 and tok.eod == 2
    ids = tok.tokenize(real_text)
    assert len(ids) < len(real_text) / 1.5  # it learned something: fewer tokens than bytes
    assert max(ids) < tok.vocab_size
    assert tok.detokenize(ids) == real_text
    assert tok.tokenize_batch(["a = 1", real_text[:100]]) == [tok.tokenize("a = 1"),
                                                              tok.tokenize(real_text[:100])]


def test_gpt2_bpe_round_trips_real_text_and_knows_endoftext(bpe_files, real_text):
    _, vocab, merges = bpe_files
    tok = GPT2BPETokenizer(vocab, merges)
    assert tok.vocab_size == 800
    assert tok.eod == 0  # the special token trained first
    ids = tok.tokenize(real_text)
    assert len(ids) < len(real_text.encode()) / 2
    assert tok.detokenize(ids) == real_text
    assert tok.tokenize("end<|endoftext|>") == tok.tokenize("end") + [tok.eod]


def test_huggingface_tokenizer_from_folder_or_file_round_trips(bpe_files, real_text):
    folder, _, _ = bpe_files
    for path in (folder, os.path.join(folder, "tokenizer.json")):
        tok = HuggingFaceTokenizer(path)
        assert tok.eod == 0 and tok.vocab_size == 800
        assert tok.detokenize(tok.tokenize(real_text)) == real_text
    gpt2 = GPT2BPETokenizer(os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt"))
    assert HuggingFaceTokenizer(folder).tokenize(real_text) == gpt2.tokenize(real_text)


def test_null_tokenizer_round_trips_ids_and_its_eod_is_the_last_id_as_in_megatron_core():
    tok = NullTokenizer(1000)
    assert tok.vocab_size == 1000 and tok.eod == 999  # Megatron-Core: vocab N, eod N - 1
    text = "5 17 998 0 42"
    assert tok.tokenize(text) == [5, 17, 998, 0, 42]
    assert tok.detokenize(tok.tokenize(text)) == text
    with pytest.raises(ValueError, match="space-separated"):
        tok.tokenize("5 cat")
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("1000")
    assert NullTokenizer(1000, eod_id=0).eod == 0  # --null-tokenizer-eod-id
    with pytest.raises(ValueError, match="--null-tokenizer-eod-id 1000 must be in"):
        NullTokenizer(1000, eod_id=1000)


def test_build_tokenizer_by_megatron_name_with_clear_errors(bpe_files, tmp_path):
    folder, vocab, merges = bpe_files

    assert isinstance(build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
                      GPT2BPETokenizer)
    assert isinstance(build_tokenizer("HuggingFaceTokenizer", tokenizer_model=folder),
                      HuggingFaceTokenizer)
    assert build_tokenizer("NullTokenizer", vocab_size=10).eod == 9
    with pytest.raises(ValueError, match="--tokenizer-type 'BertWordPiece'"):
        build_tokenizer("BertWordPiece")
    with pytest.raises(ValueError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=vocab)
    with pytest.raises(ValueError, match="--tokenizer-model .*nope.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
    with pytest.raises(ValueError, match="--vocab-size"):
        build_tokenizer("NullTokenizer")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def _tool(name):
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, "tools", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_tokenizer_tool_writes_a_usable_model(tmp_path, capsys):
    prefix = str(tmp_path / "tool")
    tool = _tool("train_tokenizer")
    assert tool.main(["--input", os.path.join(STDLIB, "json"), "--model-prefix", prefix,
                      "--vocab-size", "400", "--suffixes", ".py"]) == 0
    tok = SentencePieceTokenizer(prefix + ".model")
    assert tok.detokenize(tok.tokenize("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"
    assert tool.main(["--input", str(tmp_path / "missing"), "--model-prefix", prefix]) == 1
    assert "no such file" in capsys.readouterr().err


def test_tokenizer_training_reads_the_text_field_of_json_lines(tmp_path):
    """A .jsonl corpus: the tokenizer learns the records' text (--json-keys), not the JSON
    syntax around it; a malformed line names the file and line."""
    from gigatron.data.sentencepiece_trainer import iter_lines

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "first line\\nsecond line", "id": 1}\n\n{"text": "third"}\n')
    assert list(iter_lines([str(corpus)])) == ["first line", "second line", "third"]
    plain = tmp_path / "notes.txt"
    plain.write_text('{"text": "kept as is"}\n')
    assert list(iter_lines([str(plain)])) == ['{"text": "kept as is"}']
    corpus.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match=r"corpus.jsonl:2: no string field \['text'\]"):
        list(iter_lines([str(corpus)]))
