"""Place an installed distribution and its requirements into another environment by hard links.

    python .ci/link_installed.py torch VENV/lib/pythonX.Y/site-packages

The wheel smoke test (.ci/wheel_smoke.sh) needs torch in its fresh venv; `pip install
torch==2.13.0` there unpacks ~700 MB again (~23 s of CPU beside the tests). This links the
files pip recorded for torch and for everything its requirements pull in (RECORD, so exactly
what `pip install` put there, metadata included) from this Python's site-packages instead;
the venv's pip then sees torch installed, as on a user's machine that has it, and installs
the wheel's own requirements itself. Files on another file system are copied. Exits 1, saying
why, when a distribution's RECORD is missing, so that the caller can install it with pip.
"""
from __future__ import annotations

import os
import shutil
import sys
from importlib import metadata
from typing import Dict, List

from packaging.requirements import Requirement


def closure(name: str) -> List[metadata.Distribution]:
    """`name`'s distribution and every distribution its (non-extra) requirements need."""
    found: Dict[str, metadata.Distribution] = {}
    todo = [name]
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(found.values())


def link(dist: metadata.Distribution, target: str) -> int:
    """Link (or copy) every file of `dist` inside its site-packages into `target`."""
    files = dist.files
    if files is None:
        raise SystemExit(f"{dist.metadata['Name']}: no RECORD, cannot link it")
    count = 0
    for f in files:
        if f.parts[0] == ".." or f.is_absolute():  # scripts in bin/: the smoke test needs none
            continue
        src, dst = str(dist.locate_file(f)), os.path.join(target, *f.parts)
        if not os.path.isfile(src) or os.path.exists(dst):
            continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        count += 1
    return count


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    name, target = argv
    try:
        dists = closure(name)
        total = sum(link(d, target) for d in dists)
    except (metadata.PackageNotFoundError, SystemExit) as err:
        print(f"link_installed: {err}", file=sys.stderr)
        return 1
    names = ", ".join(f"{d.metadata['Name']} {d.version}" for d in dists)
    print(f"linked {total} files of {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
