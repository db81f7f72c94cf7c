"""`gigatron generate --load CKPT`: no model flags needed (the checkpoint's metadata.json has
them), one prompt streams, a batch prints when done, tp=2 on two CPU ranks writes the
tokens of one rank (greedy and sampled) from a checkpoint saved at tp=1, and bad flags are
one error line."""
import io
import json
import os
import sys
from contextlib import redirect_stderr, redirect_stdout

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from multirank import run_on_ranks  # noqa: E402

TRAIN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-2 --mock-data --vocab-size 100 "
         "--hidden-dropout 0 --attention-dropout 0 --train-iters 3 --eval-iters 0 "
         "--no-progress --position-embedding-type rope --normalization RMSNorm --swiglu "
         "--disable-bias-linear --group-query-attention --num-query-groups 2").split()


def _command(rank, world, module, argv):
    """`gigatron <module> argv` on this rank: (exit code, stdout, stderr)."""
    import importlib

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = importlib.import_module(f"gigatron.{module}").main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("gen") / "ckpt")
    (code, _, err), = run_on_ranks(_command, 1, "cli.pretrain", TRAIN + ["--save", folder])
    assert code == 0, err
    return folder


def _generate(folder, world, *args):
    return run_on_ranks(_command, world, "cli.generate", ["--load", folder, *args])


def _outputs(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_one_prompt_streams_with_no_model_flag(checkpoint, tmp_path):
    out = str(tmp_path / "out.jsonl")
    (code, stdout, err), = _generate(checkpoint, 1, "--prompt", "5 6 7", "--max-new-tokens",
                                     "6", "--ignore-eod", "--output", out)
    assert code == 0, err
    (record,) = _outputs(out)
    assert record["prompt"] == "5 6 7" and len(record["tokens"]) == 6
    assert stdout == "5 6 7 " + " ".join(map(str, record["tokens"])) + "\n"
    assert record["text"] == " " + " ".join(map(str, record["tokens"]))


@pytest.mark.parametrize("sampling", [[], ["--temperature", "0.9", "--top-p", "0.9",
                                           "--seed", "5"]], ids=["greedy", "sampled"])
def test_tp2_writes_the_tokens_of_one_rank(checkpoint, tmp_path, sampling):
    args = ["--prompt", "5 6 7", "--prompt", "1", "--prompt", "40 41 42 43 44",
            "--max-new-tokens", "8", *sampling]
    one, two = str(tmp_path / "tp1.jsonl"), str(tmp_path / "tp2.jsonl")
    (code, stdout, err), = _generate(checkpoint, 1, *args, "--output", one)
    assert code == 0, err
    assert stdout.count("\n\n") == 3  # a batch prints each prompt's text when done
    results = _generate(checkpoint, 2, *args, "--output", two)
    assert [r[0] for r in results] == [0, 0], results
    assert results[1][1] == ""  # rank 0 alone prints
    assert _outputs(two) == _outputs(one)
    assert {len(r["tokens"]) for r in _outputs(one)} != {0}


def test_stop_token_ends_the_prompt(checkpoint, tmp_path):
    out = str(tmp_path / "out.jsonl")
    (code, _, err), = _generate(checkpoint, 1, "--prompt", "5 6 7", "--max-new-tokens", "6",
                                "--ignore-eod", "--output", out)
    assert code == 0, err
    first = _outputs(out)[0]["tokens"][0]
    (code, _, err), = _generate(checkpoint, 1, "--prompt", "5 6 7", "--max-new-tokens", "6",
                                "--stop-token", str(first), "--output", out)
    assert code == 0, err
    assert _outputs(out)[0]["tokens"] == [first]


@pytest.mark.parametrize("args,message", [
    (["--prompt", "1", "--top-k", "3"], "--top-k / --top-p filter a sampled token"),
    (["--prompt", "1", "--pipeline-model-parallel-size", "2"],
     "pipeline-parallel generation is not supported"),
    ([], "no prompt"),
    (["--prompt", "1 x"], "NullTokenizer: text must be space-separated integers"),
])
def test_bad_flags_are_one_error_line(checkpoint, args, message):
    (code, _, err), = _generate(checkpoint, 1, *args)
    assert code == 2 and message in err and err.count("error:") == 1, err


def test_missing_checkpoint_is_named(tmp_path):
    (code, _, err), = _generate(str(tmp_path / "none"), 1, "--prompt", "1")
    assert code == 2 and "no checkpoint there" in err, err
