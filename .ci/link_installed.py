"""Place installed distributions and their requirements into another environment by hard links.

    python .ci/link_installed.py torch VENV/lib/pythonX.Y/site-packages
    python .ci/link_installed.py dist/gigatron-0.1.0-py3-none-any.whl VENV/lib/...  # its requirements

The wheel smoke test (.ci/wheel_smoke.sh) needs the wheel's requirements in its fresh venv;
`pip install` there unpacks them again (torch alone ~700 MB, ~23 s of CPU beside the tests;
the rest ~7 s). This links the files pip recorded for each requirement the wheel declares
(Requires-Dist, read from the wheel) and for everything those pull in (RECORD, so exactly what
`pip install` put there, metadata included) from this Python's site-packages instead; the
venv's pip then finds them installed, as on a user's machine that has them, checks them
against the wheel's requirements and installs the wheel. Files on another file system are
copied. Exits 1, saying why, when a distribution is not installed here or its RECORD is
missing, so that the caller can install with pip instead.
"""
from __future__ import annotations

import os
import shutil
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from typing import Dict, List

from packaging.requirements import Requirement


def needed(requires: List[str]) -> List[str]:
    """The names among Requires-Dist lines that apply here without extras."""
    reqs = [Requirement(text) for text in requires]
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def wheel_requires(path: str) -> List[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(path) as whl:
        name = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(whl.read(name).decode())
    return meta.get_all("Requires-Dist") or []


def closure(names: List[str]) -> List[metadata.Distribution]:
    """The distributions `names` and every distribution their (non-extra) requirements need."""
    found: Dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        dist = metadata.distribution(todo.pop())
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in found:
            continue
        found[key] = dist
        todo += needed(list(dist.requires or ()))
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
        roots = needed(wheel_requires(name)) if name.endswith(".whl") else [name]
        dists = closure(roots)
        total = sum(link(d, target) for d in dists)
    except (metadata.PackageNotFoundError, SystemExit) as err:
        print(f"link_installed: {err}", file=sys.stderr)
        return 1
    names = ", ".join(f"{d.metadata['Name']} {d.version}" for d in dists)
    print(f"linked {total} files of {names}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
