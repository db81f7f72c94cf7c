"""The Python half of bench/gpu_session.sh: `check` proves on a CPU that every step's command
would start (its script, module or test files exist, and its flags parse), so that a typo
cannot cost device minutes; `collect` gathers the steps' raw outputs into the few files that
come back from the device machine (results.json, summary.md).

    python3 bench/gpu_session.py check WORK/cmd_*        # each file: one command, NUL-separated
    python3 bench/gpu_session.py collect WORK OUT

check, per command: `python3 SCRIPT.py ARGS` runs SCRIPT as __main__ with argparse stopped
right after a successful parse (the script's imports run; its work does not; a script without
argparse is only compiled); `python3 -m pytest ARGS` collects ARGS in this process (the files
import, the markers select at least one test); `python3 -m MODULE` finds MODULE. Exit 1 when
any command fails, each failure one line naming the step.
"""
from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import py_compile
import runpy
import sys
from typing import Any, Dict, List, Optional

# the result lines benches print as they go: kept when a time limit stops a bench before its
# JSON is written
RESULT_PREFIXES = ("side-by-side result: ", "path result: ", "size result: ")


class _Parsed(Exception):
    """Raised by the patched parse_args once a script's flags have parsed."""


def _check_script(path: str, args: List[str]) -> Optional[str]:
    if not os.path.isfile(path):
        return f"no such script {path}"
    with open(path) as f:
        source = f.read()
    if "argparse" not in source:
        py_compile.compile(path, doraise=True)
        return None
    original = argparse.ArgumentParser.parse_args

    def parse_only(self: argparse.ArgumentParser, *a: Any, **k: Any) -> argparse.Namespace:
        original(self, *a, **k)
        raise _Parsed

    argparse.ArgumentParser.parse_args = parse_only  # type: ignore[method-assign]
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [path] + args
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            runpy.run_path(path, run_name="__main__")
    except _Parsed:
        return None
    except SystemExit as err:  # argparse's error (2) or the script's own exit
        return f"exit {err.code}: " + " ".join(stderr.getvalue().split())[-300:]
    except Exception as err:  # an import or a top-level line failed
        return f"{type(err).__name__}: {err}"[:300]
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
        sys.argv, sys.path[:] = saved_argv, saved_path
    return "the script ran past its flags without parsing them (no parse_args call)"


def _check_pytest(args: List[str]) -> Optional[str]:
    import pytest

    missing = [a for a in args if a.startswith("tests/") and not os.path.exists(a.split("::")[0])]
    if missing:
        return f"no such test file {missing}"
    # collection writes no report and needs no xdist workers
    keep = [a for i, a in enumerate(args) if not a.startswith("--junit") and a != "-n"
            and (i == 0 or args[i - 1] != "-n")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(["--collect-only", "-q"] + keep)
    if code != 0:
        return f"pytest collection exit {int(code)}: " + out.getvalue().strip()[-300:]
    counts = [line.rsplit(": ", 1) for line in out.getvalue().splitlines()
              if line.startswith("tests/") and ": " in line]  # -qq: "file: count"
    if counts:
        print(f"  pytest: {sum(int(n) for _, n in counts)} tests in {len(counts)} files")
    return None


def check_command(argv: List[str]) -> Optional[str]:
    """Why `argv` (python3 ...) would not start; None when it would."""
    if not argv or os.path.basename(argv[0]) not in ("python3", "python"):
        return f"not a python3 command: {argv[:3]}"
    if argv[1] == "-m":
        if argv[2] == "pytest":
            return _check_pytest(argv[3:])
        import importlib.util

        try:
            found = importlib.util.find_spec(argv[2]) is not None
        except ModuleNotFoundError:
            found = False
        return None if found else f"no module {argv[2]}"
    return _check_script(argv[1], argv[2:])


def check(files: List[str]) -> int:
    failed = 0
    for name in sorted(files):
        with open(name, "rb") as f:
            parts = f.read().decode().split("\0")
        step, argv = parts[0], [p for p in parts[1:] if p]
        why = check_command(argv)
        print(f"{step}: {'ok' if why is None else 'FAILS: ' + why} ({' '.join(argv)[:160]})")
        failed += why is not None
    return 1 if failed else 0


def _is_json_object(line: str) -> bool:
    if not line.startswith("{"):
        return False
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def collect(work: str, out: str) -> Dict[str, Any]:
    """Every step's JSON outputs and result lines, and its status from steps.tsv, as one
    dict (written to OUT/results.json); summary.md lists the steps and their tables."""
    steps: Dict[str, Any] = {}
    status_file = os.path.join(work, "steps.tsv")
    rows = []
    if os.path.exists(status_file):
        with open(status_file) as f:
            rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    for name, status, seconds, command in rows:
        entry: Dict[str, Any] = dict(status=status, seconds=int(seconds), command=command)
        for path in sorted(glob.glob(os.path.join(work, name, "*.json"))):
            with open(path) as f:
                entry[os.path.basename(path)] = json.load(f)
        log = os.path.join(work, f"{name}.log")
        if os.path.exists(log):
            with open(log, errors="replace") as f:
                lines = f.read().splitlines()
            entry["result_lines"] = [json.loads(l.split(": ", 1)[1]) for l in lines
                                     if l.startswith(RESULT_PREFIXES)]
            entry["json_lines"] = [json.loads(l) for l in lines if _is_json_object(l)]
            entry["tail"] = lines[-40:]
        steps[name] = entry
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(steps, f, indent=1, default=str)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write("| step | status | seconds | command |\n|---|---|---|---|\n")
        for name, e in steps.items():
            f.write(f"| {name} | {e['status']} | {e['seconds']} | `{e['command']}` |\n")
        for name, e in steps.items():
            table = [l for l in e.get("tail", []) if l.startswith("|")]
            if table:
                f.write(f"\n## {name}\n\n" + "\n".join(table) + "\n")
    return steps


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("check").add_argument("files", nargs="+")
    c = sub.add_parser("collect")
    c.add_argument("work")
    c.add_argument("out")
    args = p.parse_args(argv)
    if args.what == "check":
        return check(args.files)
    collect(args.work, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
