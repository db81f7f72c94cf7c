"""tools/preprocess_data.py: Megatron flags, exact tokens out, order kept across workers,
malformed lines reported by line number, nothing partial left behind."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gigatron.data.indexed_dataset import IndexedDataset
from gigatron.data.preprocess import main
from gigatron.data.tokenizer import GPT2BPETokenizer

STDLIB = os.path.dirname(os.__file__)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("bpe")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([os.path.join(STDLIB, "json", n) for n in ("decoder.py", "encoder.py")], trainer)
    vocab, merges = tok.model.save(str(folder))
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """JSON lines of real text: the paragraphs of a few standard-library modules."""
    folder = tmp_path_factory.mktemp("corpus")
    docs = []
    for name in ("textwrap.py", "shlex.py", "fnmatch.py"):
        text = open(os.path.join(STDLIB, name), encoding="utf-8").read()
        docs += [p for p in text.split("\n\n") if p.strip()]
    path = folder / "docs.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"text": d, "title": f"doc {i} ✓"}) + "\n")
    return str(path), docs


def _read_docs(prefix):
    ds = IndexedDataset(prefix)
    ds.verify()
    return ds, [ds.document(d).tolist() for d in range(ds.num_documents)]


def test_jsonl_tokens_match_the_tokenizer_with_eod_for_each_key(tmp_path, bpe, corpus, capsys):
    path, docs = corpus
    out = str(tmp_path / "out")
    assert main(["--input", path, "--output-prefix", out, "--json-keys", "text", "title",
                 "--append-eod", "--log-interval", "50"] + bpe) == 0
    tok = GPT2BPETokenizer(bpe[3], bpe[5])
    ds, got = _read_docs(out + "_text_document")
    assert ds.dtype == np.uint16 and len(got) == len(docs)
    assert got == [tok.tokenize(d) + [tok.eod] for d in docs]
    _, titles = _read_docs(out + "_title_document")
    assert titles[7] == tok.tokenize("doc 7 ✓") + [tok.eod]
    err = capsys.readouterr().err
    assert "docs/s" in err and "MB/s" in err and "processed 50 documents" in err


def test_two_workers_write_byte_identical_files(tmp_path, bpe, corpus):
    path, _ = corpus
    outputs = []
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        assert main(["--input", path, "--output-prefix", out, "--workers", str(workers),
                     "--append-eod"] + bpe) == 0
        outputs.append([open(f"{out}_text_document{ext}", "rb").read() for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[1]


def test_plain_text_folder_gives_one_document_per_file_in_sorted_order(tmp_path, bpe):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    texts = {"b.txt": "second file\n", "a.txt": "first file\n", "sub/c.md": "third\n"}
    for name, text in texts.items():
        (folder / name).write_text(text)
    out = str(tmp_path / "plain")
    assert main(["--input", str(folder), "--output-prefix", out] + bpe) == 0
    tok = GPT2BPETokenizer(bpe[3], bpe[5])
    _, got = _read_docs(out + "_text_document")
    assert got == [tok.tokenize(texts[n]) for n in ("a.txt", "b.txt", "sub/c.md")]


def _bad_jsonl(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = ['{"text": "good one"}', '{"text": "broken', '{"text": "good two"}', "",
             '[1, 2]', '{"other": "no text key"}', '{"text": "good three"}']
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_malformed_json_is_fatal_by_default_and_leaves_nothing(tmp_path, bpe, capsys, workers):
    path = _bad_jsonl(tmp_path)
    out = str(tmp_path / "o")
    assert main(["--input", path, "--output-prefix", out, "--workers", workers] + bpe) == 1
    err = capsys.readouterr().err
    assert f"{path}:2: malformed JSON" in err and "--invalid-json skip" in err
    assert os.listdir(tmp_path) == ["bad.jsonl"]  # no output, no temporary files


def test_malformed_json_lines_skipped_and_reported_with_line_numbers(tmp_path, bpe, capsys):
    path = _bad_jsonl(tmp_path)
    out = str(tmp_path / "o")
    assert main(["--input", path, "--output-prefix", out, "--invalid-json", "skip"] + bpe) == 0
    err = capsys.readouterr().err
    for lineno in (2, 5, 6):
        assert f"skipping {path}:{lineno}:" in err
    assert "skipped 3 malformed lines" in err
    tok = GPT2BPETokenizer(bpe[3], bpe[5])
    _, got = _read_docs(out + "_text_document")
    assert got == [tok.tokenize(t) for t in ("good one", "good two", "good three")]


def test_failed_run_keeps_a_previous_output_intact(tmp_path, bpe):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "hello world"}\n')
    out = str(tmp_path / "o")
    assert main(["--input", str(good), "--output-prefix", out] + bpe) == 0
    before = open(out + "_text_document.bin", "rb").read()
    assert main(["--input", _bad_jsonl(tmp_path), "--output-prefix", out] + bpe) == 1
    assert open(out + "_text_document.bin", "rb").read() == before
    assert not [f for f in os.listdir(tmp_path) if ".tmp-" in f]


def test_command_line_tool_with_null_tokenizer(tmp_path):
    data = tmp_path / "ids.jsonl"
    data.write_text('{"text": "1 2 3"}\n{"text": "70000 4"}\n')
    out = str(tmp_path / "n")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                           "--input", str(data), "--output-prefix", out, "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "80001", "--append-eod"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    ds, got = _read_docs(out + "_text_document")
    assert ds.dtype == np.int32 and got == [[1, 2, 3, 80000], [70000, 4, 80000]]
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"),
                          "--input", str(data), "--output-prefix", out, "--tokenizer-type",
                          "NullTokenizer"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "--vocab-size" in bad.stderr
