"""The `gigatron` console command: one subcommand per module of this package.

A subcommand is a module `gigatron.cli.<name>` (underscores become dashes on the command
line) whose docstring's first line is its help line and whose `main(argv) -> int` runs it.
Adding a command is adding a module; modules whose name starts with `_` are not commands.
Command modules import their heavy code inside `main`, so `gigatron --help` stays fast.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import sys
from types import ModuleType
from typing import Dict, List, Optional, Sequence

PROG = "gigatron"


def commands() -> Dict[str, str]:
    """Command name -> module name, for every command module in this package."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_"):
            found[info.name.replace("_", "-")] = f"{__name__}.{info.name}"
    return dict(sorted(found.items()))


def _help_line(module: ModuleType) -> str:
    return (module.__doc__ or "").strip().splitlines()[0] if module.__doc__ else ""


def version() -> str:
    """The installed package's version (setup.py's), as `pip show gigatron` gives it."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version(PROG)
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed: pip install -e .)"


def usage() -> str:
    """`gigatron --help`: the subcommands, one line each."""
    table = commands()
    width = max(len(name) for name in table)
    lines = [f"usage: {PROG} COMMAND [ARGS ...]   ({PROG} COMMAND --help for a command's flags; "
             f"{PROG} --version)",
             "", "commands:"]
    for name, module in table.items():
        lines.append(f"  {name:<{width}}  {_help_line(importlib.import_module(module))}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Dispatch `gigatron COMMAND ARGS` to `gigatron.cli.<command>.main(ARGS)`; a reader that
    stops early (`gigatron --help | head -3`) ends the command quietly."""
    try:
        try:
            return _dispatch(list(sys.argv[1:] if argv is None else argv))
        finally:  # (argparse's --help exits): a closed pipe shows here, not at exit
            sys.stdout.flush()
    except BrokenPipeError:
        # nothing more can be shown: point stdout at /dev/null so Python's final flush is
        # silent, and exit as a shell reports a program stopped by SIGPIPE (128 + 13)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _dispatch(args: List[str]) -> int:
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"{PROG} {version()}")
        return 0
    name, rest = args[0], args[1:]
    table = commands()
    if name not in table:
        print(f"{PROG}: unknown command {name!r}; choose from {', '.join(table)} "
              f"({PROG} --help lists them)", file=sys.stderr)
        return 2
    # argparse names the program after sys.argv[0]: make usage lines read `gigatron COMMAND`
    sys.argv = [f"{PROG} {name}"] + rest
    return int(importlib.import_module(table[name]).main(rest) or 0)
