"""`python -m gigatron.models.zoo`: the README's model-zoo line, generated from the zoo's files.

    python -m gigatron.models.zoo                    # print the line
    python -m gigatron.models.zoo --readme README.md # rewrite that line of the README in place

tests/test_readme_zoo.py fails when README.md's line differs from the zoo (a model added or
removed without regenerating it).
"""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

from gigatron.models.zoo import list_models

PREFIX = "Model zoo (`--model NAME`"


def zoo_line(names: Optional[Sequence[str]] = None) -> str:
    """The README's line naming every zoo model, in list_models() order."""
    names = list_models() if names is None else names
    return (f"{PREFIX}; flags override its values; regenerate this line with `python -m "
            f"gigatron.models.zoo --readme README.md`): "
            + ", ".join(f"`{name}`" for name in names) + ".")


def rewrite(lines: List[str]) -> List[str]:
    """`lines` with its zoo line replaced by the current one (exactly one must be there)."""
    found = [i for i, line in enumerate(lines) if line.startswith(PREFIX)]
    if len(found) != 1:
        raise ValueError(f"expected one line starting with {PREFIX!r}, found {len(found)}")
    return lines[:found[0]] + [zoo_line()] + lines[found[0] + 1:]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gigatron.models.zoo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--readme", default=None, metavar="PATH",
                        help="rewrite the zoo line of this Markdown file in place")
    args = parser.parse_args(argv)
    if args.readme is None:
        print(zoo_line())
        return 0
    with open(args.readme, encoding="utf-8") as f:
        lines = f.read().split("\n")
    try:
        lines = rewrite(lines)
    except ValueError as err:
        print(f"{args.readme}: {err}", file=sys.stderr)
        return 1
    with open(args.readme, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
