"""Every command line the docs show parses with the real parsers, so the docs cannot drift
from the code: in README.md and docs/*.md (new pages included), each fenced shell line that
runs `gigatron COMMAND ...`, `python -m gigatron COMMAND ...`, `pretrain_gpt.py ...` or
`tools/*.py` — also behind `torchrun ...` or `gigatron launch ...`, with `\\` continuation
lines joined — is handed to its command's own parser, in this process (argparse only: nothing
is trained, loaded or written).

Indented code blocks are read too, where a line starts with such a command.
What is checked: the command exists, every flag is known, every value has its type and
choice; for pretrain_gpt.py's flags not their combination (that needs the data). What is
skipped: placeholders that are clearly not literal (`...`, `<the run's flags>`, an
ALL-CAPS word where a number goes: `--node_rank K`), usage synopses (`[--num_gpus N | -np N]`),
and lines of non-shell fences unless they start with a `$ ` prompt.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import os
import re
import shlex
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple
from unittest import mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "zsh"}
OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>", "2>&1"}
# commands whose unparsed rest is pretrain_gpt.py's flags (the model and data of a checkpoint)
REST_IS_PRETRAIN = {"evaluate", "generate", "plan"}
TOOLS = {"pretrain_gpt.py": "pretrain", "preprocess_data.py": "preprocess-data",
         "train_tokenizer.py": "train-tokenizer"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")
INDENTED_COMMAND = re.compile(r"^(gigatron |python3? (-m gigatron |\S*pretrain_gpt\.py|tools/)|"
                              r"torchrun |\S*pretrain_gpt\.py )")


def pages() -> List[str]:
    """README.md and every page of docs/, relative to the repository root."""
    found = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md"] + [os.path.relpath(p, ROOT) for p in found]


def shell_lines(text: str) -> List[Tuple[int, str]]:
    """(line number, logical line) of each command line in a fenced block: every line of a
    shell fence, `$ ` lines of other fences; and of an indented code block, the lines that
    start with a gigatron command; continuation lines joined."""
    out: List[Tuple[int, str]] = []
    fence: Optional[str] = None
    pending, start = "", 0
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            pending = ""
            continue
        if fence is None and not pending:
            # an indented code block (4 spaces) that runs a command: checked as a shell fence
            if not (line.startswith("    ") and INDENTED_COMMAND.match(stripped)):
                continue
        if not pending:
            start = number
            if fence is not None and fence not in SHELL_FENCES:
                if not stripped.startswith("$ "):
                    continue
            if stripped.startswith("$ "):
                stripped = stripped[2:]
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def simple_commands(line: str) -> List[List[str]]:
    """The simple commands of a shell line (split at && || ; |, comments and redirections
    dropped), placeholders `<...>` and `...` removed."""
    line = re.sub(r"<[^<>]*>", " ", line)
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: prose in a plain fence (`Megatron's file`)
        tokens = line.split()
    commands, current = [], []
    for token in tokens:
        if token in OPERATORS or set(token) <= set(";&|<>"):
            commands.append(current)
            current = []
        elif token != "...":
            current.append(token)
    commands.append(current)
    return [c for c in commands if c]


@dataclass
class Command:
    """A gigatron command found in a line: its name and arguments."""

    name: str
    args: List[str]


def _drop_env(words: List[str]) -> List[str]:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return words


def _script_command(script: str, args: List[str], module: bool = False) -> Optional[Command]:
    """The command a script (or `-m module`) name runs, if it is one of gigatron's."""
    if script == "gigatron" and args:
        # `gigatron launch: rank 1 failed`: the program's output, quoted in the docs
        return None if args[0].endswith(":") else Command(args[0], args[1:])
    if not module and os.path.basename(script) in TOOLS:
        return Command(TOOLS[os.path.basename(script)], args)
    return None


def _torchrun(args: List[str]) -> Optional[Command]:
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(args)  # torchrun's own flags: its parser's errors
    script, rest = parsed.training_script, list(parsed.training_script_args)
    return _script_command(script, rest, module=parsed.module)


def find_command(words: List[str]) -> Optional[Command]:
    """The gigatron command a simple command runs (directly, through python, python -m or
    torchrun), or None for anything else (pip, cd, a user's train.py...)."""
    words = _drop_env(words)
    if not words:
        return None
    if words[0] in ("python", "python3"):
        words = [w for w in words[1:] if w != "-u"]
        if words[:2] == ["-m", "gigatron"]:
            return Command(words[2], words[3:]) if len(words) > 2 else None
        return _script_command(words[0], words[1:]) if words else None
    if words[0] == "torchrun":
        return _torchrun(words[1:])
    return _script_command(words[0], words[1:])


class _Parsed(Exception):
    """Raised by the patched argparse once a command's parser has read its arguments."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 rest: List[str]) -> None:
        super().__init__()
        self.parser, self.namespace, self.rest = parser, namespace, rest


def _parse_only(command: Command) -> _Parsed:
    """Run `gigatron COMMAND ARGS` until its first parser has read the arguments, and stop
    there (argparse's parse_known_args is patched to raise with what it read)."""
    from gigatron import cli

    original = argparse.ArgumentParser.parse_known_args

    def parse_then_stop(self, args=None, namespace=None):
        namespace, rest = original(self, args, namespace)
        raise _Parsed(self, namespace, rest)

    err = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", parse_then_stop), \
            mock.patch("sys.argv", ["gigatron"]), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main([command.name] + command.args)
        except _Parsed as parsed:
            return parsed
        except SystemExit as stop:
            raise ValueError(err.getvalue().strip().splitlines()[-1] if err.getvalue()
                             else f"exit {stop.code}") from None
    raise ValueError(err.getvalue().strip() or f"returned {code} before parsing its flags")


def _pretrain_problems(args: Sequence[str]) -> List[str]:
    from gigatron.training.config.arguments import make_parser
    from gigatron.training.config.table import ParseProblems

    try:
        make_parser().parse_args(list(args))
    except ParseProblems as err:
        return err.problems
    return []


def check_command(command: Command) -> List[str]:
    """Why this command line would not parse (empty: it parses)."""
    try:
        parsed = _parse_only(command)
    except ValueError as err:
        return [str(err)]
    problems = list(getattr(parsed.parser, "problems", []))  # the config table's bad values
    rest = parsed.rest
    if command.name == "pretrain":
        problems += _pretrain_problems(command.args) if rest else []
    elif command.name in REST_IS_PRETRAIN:
        problems += _pretrain_problems(rest)
    elif rest:
        problems.append(f"unrecognized arguments: {' '.join(rest)}")
    if command.name == "launch" and not problems:
        inner = _script_command(parsed.namespace.script, list(parsed.namespace.script_args))
        problems += check_command(inner) if inner else []
    return problems


def _is_placeholder_problem(problem: str, words: Sequence[str]) -> bool:
    """A bad value that is a placeholder word of the docs (`--node_rank K`)."""
    value = re.search(r"invalid \w+ value: '([^']*)'", problem)
    return bool(value) and bool(PLACEHOLDER.match(value.group(1))) and value.group(1) in words


def check_text(text: str) -> Tuple[List[str], int]:
    """(problems, commands checked) of a Markdown text."""
    problems, checked = [], 0
    for number, line in shell_lines(text):
        if "[--" in line or "(script.py |" in line:  # a usage synopsis, not a command
            continue
        for words in simple_commands(line):
            try:
                command = find_command(words)
            except SystemExit:
                problems.append(f"line {number}: torchrun's flags do not parse: {line}")
                continue
            if command is None:
                continue
            checked += 1
            for problem in check_command(command):
                if not _is_placeholder_problem(problem, words):
                    problems.append(f"line {number}: {problem}: {line}")
    return problems, checked


@pytest.mark.parametrize("page", pages())
def test_every_documented_command_parses(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        problems, _ = check_text(f.read())
    assert problems == [], "\n".join([f"{page}:"] + problems)


def test_the_docs_show_commands_of_every_kind():
    """The check reaches the commands: the README's and the docs' lines are found."""
    counts: Dict[str, int] = {}
    for page in pages():
        with open(os.path.join(ROOT, page), encoding="utf-8") as f:
            counts[page] = check_text(f.read())[1]
    assert counts["README.md"] >= 5 and sum(counts.values()) >= 40, counts


BAD = """
```bash
gigatron launch --num_gpus 2 gigatron pretrain --model debug-gpt2 \\
    --mock-data --no-such-flag 3
```
"""


@pytest.mark.parametrize("text, expected", [
    (BAD, "--no-such-flag"),
    ("```\ntorchrun --nproc-per-node 2 pretrain_gpt.py --bf16 --zero-stage 7\n```",
     "--zero-stage: invalid choice: 7"),
    ("```bash\npython -m gigatron preprocess-data --input x --bogus\n```", "--bogus"),
    ("```\n$ gigatron evaluate --load ckpt --tensor-model-parallel-size two\n```",
     "invalid int value: 'two'"),
    ("```text\n$ gigatron pretrian --help\n```", "unknown command 'pretrian'"),
    ("```bash\ngigatron topology --world-size 8 && gigatron plan --gpu h100-sxm --lrr 1\n```",
     "--lrr"),
    ("Run:\n\n    gigatron plan --gpu h100-sxm \\\n        --num-gpus 8 --lrr 1\n", "--lrr"),
], ids=["launch-continuation", "torchrun", "python-m", "prompt", "command", "chain",
        "indented"])
def test_an_injected_bad_flag_fails_the_check(text, expected):
    problems, checked = check_text(text)
    assert checked >= 1 and len(problems) == 1 and expected in problems[0], problems


def test_placeholders_and_other_programs_are_skipped():
    text = """
```
gigatron launch [--num_gpus N | -np N] (script.py | gigatron COMMAND) [args]
gigatron launch --num_nodes 2 --num_gpus 8 --node_rank K train.py --whatever
python pretrain_gpt.py --load ckpt <the run's flags> ...
pip install -e . && cd /tmp   # not ours
gigatron launch: rank 1 failed (output, not a command)
```
```python
gigatron.initialize(--no-such-flag)
```
"""
    problems, checked = check_text(text)
    assert problems == [] and checked == 2, problems
