"""The `gigatron` console command: subcommands, their help, and the root scripts delegating."""
import os
import subprocess
import sys

import pytest

from gigatron import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ["convert", "evaluate", "generate", "launch", "plan", "plot", "preprocess-data", "pretrain", "report", "schedule", "topology",
            "train-tokenizer"]


def gigatron(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gigatron", *args], capture_output=True,
                          text=True, cwd=cwd)


def test_every_module_of_gigatron_cli_is_a_command():
    assert list(cli.commands()) == COMMANDS


def test_help_lists_each_command_on_one_line():
    proc = gigatron("--help")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for name in COMMANDS:
        (line,) = [l for l in lines if l.startswith(f"  {name} ")]
        assert len(line.split(None, 1)[1]) > 20, line  # a real description, not blank


def gigatron_in_process(capsys, monkeypatch, *args):
    """`gigatron ARGS` through the console command's own entry (cli.main) in this process:
    (exit code, stdout, stderr). The subprocess tests here show the entry is the command's."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the dispatcher renames the program
    try:
        code = cli.main(list(args))
    except SystemExit as stop:  # argparse's --help
        code = stop.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name", [c for c in COMMANDS if c != "pretrain"])
def test_subcommand_help_shows_defaults(name, capsys, monkeypatch):
    code, out, err = gigatron_in_process(capsys, monkeypatch, name, "--help")
    assert code == 0, err
    assert out.startswith(f"usage: gigatron {name} ")
    assert "(default: " in out


def test_pretrain_help_is_megatrons_parser():
    proc = gigatron("pretrain", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "--tensor-model-parallel-size" in proc.stdout


def test_unknown_command_is_one_line_naming_the_choices():
    proc = gigatron("pretrian")
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "unknown command 'pretrian'" in proc.stderr and "pretrain" in proc.stderr


def test_no_command_prints_usage_and_fails():
    proc = gigatron()
    assert proc.returncode == 2 and "commands:" in proc.stderr


def test_topology_and_schedule_print_the_views():
    out = gigatron("topology", "--world-size", "4", "--tp", "2").stdout
    assert "world size 4: tp=2 dp=2 pp=1" in out
    out = gigatron("schedule", "--pp", "2", "--num-microbatches", "2").stdout
    assert out.startswith("stage 0: |F0 |F1 |") and "bubble 33.3%" in out


@pytest.mark.parametrize("args, code", [(["--help"], 141), (["report"], 141),
                                        (["launch", "--help"], 0)],
                         ids=["help", "report", "launch-help"])
def test_output_into_a_closed_pipe_ends_quietly(args, code):
    """`gigatron --help | head -3`: the reader has gone before the output is written (the
    pipe's read end is closed first, so the write always fails): no BrokenPipeError
    traceback; the exit status a shell gives a program stopped by SIGPIPE (argparse's own
    --help ignores the error and exits 0)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "gigatron", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True)
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == code, proc.stderr


def test_bad_layout_is_one_line_not_a_traceback():
    proc = gigatron("topology", "--world-size", "6", "--tp", "4")
    assert proc.returncode == 2 and "not divisible" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_pretrain_bad_flag_is_one_line(tmp_path):
    proc = gigatron("pretrain", "--model", "no-such-model", "--mock-data", cwd=tmp_path)
    assert proc.returncode == 2
    assert "no-such-model" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("script, name", [("tools/train_tokenizer.py", "train-tokenizer"),
                                          ("tools/preprocess_data.py", "preprocess-data")])
def test_root_tools_delegate_to_the_same_parser(script, name):
    tool = subprocess.run([sys.executable, os.path.join(REPO, script), "--help"],
                          capture_output=True, text=True)
    command = gigatron(name, "--help")
    assert tool.returncode == command.returncode == 0
    # the same flags and help: only the program name in the usage line differs
    assert tool.stdout.split("options:")[1] == command.stdout.split("options:")[1]


def test_train_tokenizer_end_to_end(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a tiny corpus with words" for i in range(200)))
    proc = gigatron("train-tokenizer", "--input", str(corpus), "--model-prefix",
                    str(tmp_path / "spm"), "--vocab-size", "300", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "spm.model").is_file()
    proc = gigatron("train-tokenizer", "--input", str(tmp_path / "missing"), "--model-prefix",
                    str(tmp_path / "x"), cwd=tmp_path)
    assert proc.returncode == 1 and "no such file or directory" in proc.stderr


def test_gigatron_pretrain_names_itself_in_its_errors(capsys):
    """The console command's usage and error lines say `gigatron pretrain`, the script's
    say `pretrain_gpt.py` (tests/test_e2e_training.py checks the script)."""
    from gigatron.cli import main

    assert main(["pretrain", "--bogus", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gigatron pretrain: error: "), err  # with the other problems
    assert "unknown flag(s) --bogus 1" in err
    assert "see gigatron pretrain --help" in err


def test_schedule_view_explains_its_bubble_and_names_its_own_flags(capsys):
    from gigatron.parallel.pipeline.render import main

    assert main(["--pp", "2", "--num-microbatches", "2"]) == 0
    out = capsys.readouterr().out
    assert "bubble 33.3%" in out and "bubble: share of the step a stage sits idle" in out
    with pytest.raises(SystemExit):
        main(["--pp", "4", "--num-microbatches", "3", "--virtual-chunks", "2"])
    err = capsys.readouterr().err
    assert "--num-microbatches (3)" in err and "--pp=4" in err, err
    assert "--global-batch-size" not in err and "--pipeline-model-parallel-size" not in err


def test_train_tokenizer_vocabulary_too_large_for_the_text_names_the_flag_and_limit(tmp_path):
    """The README's --vocab-size 32000 on a small corpus: SentencePiece's INTERNAL error
    becomes one line naming --vocab-size and the largest size this text allows."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"line {i} of a tiny corpus with words" for i in range(200)))
    proc = gigatron("train-tokenizer", "--input", str(corpus), "--model-prefix",
                    str(tmp_path / "spm"), "--vocab-size", "32000", cwd=tmp_path)
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: --vocab-size 32000 is more than this text gives (at most ")
    limit = int(line.split("at most ")[1].split()[0])
    assert f"give --vocab-size {limit} or less, or more text" in line
    ok = gigatron("train-tokenizer", "--input", str(corpus), "--model-prefix",
                  str(tmp_path / "spm"), "--vocab-size", str(limit), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr  # the limit it names works


def test_version_prints_the_installed_packages_version(capsys):
    from importlib.metadata import version

    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr().out == f"gigatron {version('gigatron')}\n"
    proc = gigatron("--version")  # python -m gigatron, as the console command
    assert proc.returncode == 0 and proc.stdout == f"gigatron {version('gigatron')}\n"
