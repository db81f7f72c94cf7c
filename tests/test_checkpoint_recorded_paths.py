"""A checkpoint's tokenizer and data paths work from any folder (issue 38, item 2).

A run trains from its own folder with relative paths (--tokenizer-model spm.model
--data-path corpus, as the quickstart does). Its checkpoint records them as absolute paths
and stores the SentencePiece model in the iteration folder, so `gigatron generate` and
`gigatron evaluate` run from another folder, with the original model file moved away,
through the stored copy. With neither the copy nor the original, or the relative paths an
older checkpoint recorded, the error is one line per path naming the checkpoint, the path
and the flag that overrides it; that flag then works.
"""
import json
import os
import shutil
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multirank import run_on_ranks  # noqa: E402
from test_generation_cli import _command  # noqa: E402

from gigatron.training.checkpoint import recorded_paths  # noqa: E402

TRAIN = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --train-iters 2 "
         "--eval-iters 1 --eval-interval 2 --split 50,50,0 --no-progress "
         "--tokenizer-type SentencePieceTokenizer --tokenizer-model spm.model "
         "--data-path corpus --save ckpt").split()
ITERATION = "iter_0000002"


def _in_folder(rank, world, folder, module, argv):
    """`gigatron <module> argv` run from `folder`."""
    os.chdir(folder)
    return _command(rank, world, module, argv)


def _run(folder, module, *argv):
    (result,) = run_on_ranks(_in_folder, 1, str(folder), module, list(argv))
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the run's folder, its checkpoint, where the original spm.model was moved to)."""
    from gigatron.data.indexed_dataset import IndexedDatasetBuilder
    from gigatron.data.sentencepiece_trainer import train_sentencepiece
    from gigatron.data.tokenizer import SentencePieceTokenizer

    root = tmp_path_factory.mktemp("recorded")
    work = root / "run"
    work.mkdir()
    text = open(os.path.join(os.path.dirname(os.__file__), "textwrap.py"),
                encoding="utf-8").read()
    (root / "corpus.txt").write_text(text)
    model = train_sentencepiece([str(root / "corpus.txt")], str(work / "spm"), vocab_size=400,
                                num_threads=1)
    tokenizer = SentencePieceTokenizer(model)
    builder = IndexedDatasetBuilder(str(work / "corpus.bin"), np.int32)
    for i in range(40):
        tokens = tokenizer.tokenize(text[i * 400:(i + 1) * 400]) + [tokenizer.eod]
        builder.add_document(np.asarray(tokens), [len(tokens)])
    builder.finalize(str(work / "corpus.idx"))
    code, _, err = _run(work, "cli.pretrain", *TRAIN)
    assert code == 0, err
    moved = str(root / "moved.model")
    os.replace(model, moved)  # from now on only the checkpoint's copy exists
    return work, str(work / "ckpt"), moved


def _metadata(ckpt):
    with open(os.path.join(ckpt, ITERATION, "metadata.json")) as f:
        return json.load(f)


def test_the_checkpoint_records_absolute_paths_and_a_copy_of_the_tokenizer(trained):
    work, ckpt, moved = trained
    metadata = _metadata(ckpt)
    assert metadata["flags"]["tokenizer_model"] == str(work / "spm.model")
    assert metadata["flags"]["data_path"] == [str(work / "corpus")]
    copy = os.path.join(ckpt, ITERATION, "tokenizer", "tokenizer_model", "spm.model")
    assert open(copy, "rb").read() == open(moved, "rb").read()
    assert metadata["tokenizer_files"]["tokenizer_model"]["stored"] == \
        "tokenizer/tokenizer_model/spm.model"


def test_generate_and_evaluate_from_another_folder_use_the_stored_copy(trained, tmp_path):
    _, ckpt, _ = trained
    out = str(tmp_path / "out.jsonl")
    code, _, err = _run(tmp_path, "cli.generate", "--load", ckpt, "--prompt", "def wrap",
                        "--max-new-tokens", "3", "--ignore-eod", "--output", out)
    assert code == 0, err
    with open(out) as f:
        assert len(json.loads(f.readline())["tokens"]) == 3
    code, stdout, err = _run(tmp_path, "cli.evaluate", "--load", ckpt)
    assert code == 0, err
    assert "valid split: 2 samples" in stdout, stdout


def _without_copy(ckpt, where, **flags):
    """A copy of the checkpoint in `where` without its stored tokenizer; `flags` replace
    recorded ones (as an older checkpoint recorded them)."""
    copy = str(where / "ckpt")
    shutil.copytree(ckpt, copy)
    shutil.rmtree(os.path.join(copy, ITERATION, "tokenizer"))
    path = os.path.join(copy, ITERATION, "metadata.json")
    metadata = _metadata(copy)
    metadata["flags"].update(flags)
    with open(path, "w") as f:
        json.dump(metadata, f)
    return copy


def test_without_copy_or_original_one_line_names_the_override(trained, tmp_path):
    work, ckpt, _ = trained
    copy = _without_copy(ckpt, tmp_path)
    code, _, err = _run(tmp_path, "cli.generate", "--load", copy, "--prompt", "def wrap",
                        "--max-new-tokens", "2")
    assert code == 2
    assert err == (f"gigatron generate: error: checkpoint {copy}/{ITERATION} records "
                   f"--tokenizer-model {work / 'spm.model'}, which does not exist, and holds "
                   f"no copy of it: give --tokenizer-model PATH\n"), err


def test_relative_paths_of_an_older_checkpoint_name_each_override(trained, tmp_path):
    """The report's case: a checkpoint that recorded runs/quickstart/... relative paths,
    evaluated from another folder; the flags the lines name make it work."""
    work, ckpt, moved = trained
    copy = _without_copy(ckpt, tmp_path, tokenizer_model="runs/quickstart/spm.model",
                         data_path=["runs/quickstart/corpus"])
    code, _, err = _run(tmp_path, "cli.evaluate", "--load", copy)
    assert code == 2
    lines = err.splitlines()
    assert lines[0] == "gigatron evaluate: error: 2 problems:", err
    assert "records --tokenizer-model runs/quickstart/spm.model, which does not exist " \
        "(relative to the folder the training ran in, not this one)" in lines[1], err
    assert lines[1].endswith("give --tokenizer-model PATH"), err
    assert f"checkpoint {copy}/{ITERATION} records --data-path prefix runs/quickstart/" \
        f"corpus, but runs/quickstart/corpus.bin does not exist" in lines[2], err
    assert "give --data-path PREFIX" in lines[2], err
    code, _, err = _run(tmp_path, "cli.evaluate", "--load", copy, "--tokenizer-model", moved,
                        "--data-path", str(work / "corpus"))
    assert code == 0, err


def test_tokenizer_files_are_stored_only_when_small_and_present(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    for name, size in (("tokenizer.json", 300), ("tokenizer_config.json", 20),
                       ("model.safetensors", 5000)):
        (folder / name).write_bytes(b"x" * size)
    flags = recorded_paths.recorded_flags({"tokenizer_model": str(folder)})
    record = recorded_paths.tokenizer_record(flags, limit=1000)
    entry = record["tokenizer_files"]["tokenizer_model"]
    assert sorted(entry["files"]) == ["tokenizer.json", "tokenizer_config.json"]  # no weights
    assert recorded_paths.tokenizer_record(flags, limit=320) == {}  # too big: paths only
    iteration = tmp_path / "iter"
    kept = recorded_paths.store_tokenizer(str(iteration), {"flags": flags, **record})
    assert sorted(os.listdir(iteration / "tokenizer" / "tokenizer_model")) == \
        ["tokenizer.json", "tokenizer_config.json"]
    assert recorded_paths.stored_tokenizer_flags(str(iteration), kept) == {
        "tokenizer_model": str(iteration / "tokenizer" / "tokenizer_model")}
    os.remove(folder / "tokenizer_config.json")  # gone before the save: not stored, no error
    assert "tokenizer_files" not in recorded_paths.store_tokenizer(str(tmp_path / "i2"), record)
