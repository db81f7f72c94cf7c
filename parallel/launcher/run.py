"""Start a planned job and, when a rank fails, say which one and why in a few lines.

This node's part goes through torch's elastic agent in this process (`torch.distributed.run`
with the very arguments `--dry_run` prints), so torch does the rendezvous, the environment,
and stopping the other workers when one fails; we catch its ChildFailedError and print a
short report instead of the agent's traceback. Other launchers (pdsh, ssh, mpirun, srun) run
as child processes; the first to fail stops the rest.
"""
from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

from .commands import Command
from .plan import LaunchPlan
from .worker import ERROR_DIR_ENV

PROG = "gigatron launch"
TAIL_LINES = 6  # of a rank's log when it left no traceback
TRACEBACK_LINES = 3  # the failing line and the exception: the rest is on stderr above
STOP_GRACE_SECONDS = 5.0


@dataclass
class RankFailure:
    """One failed rank as the launcher saw it."""

    rank: int
    exitcode: int
    message: str  # "ValueError: boom", "killed by SIGKILL", "exited with code 3"
    lines: List[str] = field(default_factory=list)  # its last error lines
    when: float = 0.0
    log: Optional[str] = None


def read_error_file(path: Optional[str]) -> Dict[str, Any]:
    """{'message', 'callstack', 'time'} from a worker's error file ({} when absent or bad)."""
    if not path or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            message = json.load(f)["message"]
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        return {"message": message["message"] if isinstance(message, dict) else str(message),
                "callstack": extra.get("py_callstack", ""),
                "time": float(extra.get("time", extra.get("timestamp", 0)))}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def tail(path: Optional[str], count: int = TAIL_LINES) -> List[str]:
    """The last `count` non-blank lines of a text file ([] when there is none)."""
    if not path or not os.path.isfile(path):
        return []
    with open(path, errors="replace") as f:
        lines = [line.rstrip() for line in f if line.strip()]
    return lines[-count:]


def exit_message(exitcode: int) -> str:
    """'exited with code 3' or 'killed by SIGKILL'."""
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def describe_failure(rank: int, exitcode: int, error_file: Optional[str],
                     log_dir: Optional[str], when: float = 0.0) -> RankFailure:
    """A rank's failure from its error file (traceback) or else its exit code and log."""
    log = os.path.join(log_dir, f"rank{rank}.log") if log_dir else None
    record = read_error_file(error_file)
    if record:
        lines = record["callstack"].rstrip().splitlines()[-TRACEBACK_LINES:]
        return RankFailure(rank, exitcode, record["message"], lines, record["time"], log)
    return RankFailure(rank, exitcode, exit_message(exitcode), tail(log), when, log)


def first_failures(failures: Sequence[RankFailure]) -> List[RankFailure]:
    """The ranks that failed on their own, earliest first: not those the agent stopped
    (SIGTERM, no error recorded) because another had failed."""
    own = [f for f in failures if f.exitcode != -signal.SIGTERM or f.lines]
    return sorted(own or failures, key=lambda f: (f.when, f.rank))


def format_report(failures: Sequence[RankFailure], stopped_others: bool = True) -> str:
    """A few lines: the first failed rank, why, its last error lines, where its log is."""
    failures = first_failures(failures)
    first = failures[0]
    others = sorted(f.rank for f in failures if f is not first)
    head = f"{PROG}: rank {first.rank} failed ({first.message})"
    if stopped_others:
        head += "; the other ranks were stopped"
    lines = [head] + [f"  | {line}" for line in first.lines]
    if first.log:
        lines.append(f"  its log: {first.log}")
    if others:
        lines.append(f"  rank(s) {', '.join(map(str, others))} failed as well")
    return "\n".join(lines)


@contextlib.contextmanager
def _quiet_torch_elastic() -> Iterator[None]:
    """Keep the agent's own log lines (and its failure box) off the console while it runs."""
    parent = logging.getLogger("torch.distributed")  # torch gives it a stderr handler
    saved = (parent.propagate, parent.handlers)
    parent.handlers, parent.propagate = [logging.NullHandler()], False
    try:
        yield
    finally:
        parent.propagate, parent.handlers = saved


def _startup_error(error: BaseException, plan: LaunchPlan) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "EADDRINUSE" in str(error) or "address already in use" in str(error):
        return (f"{PROG}: --master_port {plan.master_port} is in use on this machine: pick "
                f"another port (both nodes must use the same)")
    return (f"{PROG}: node {plan.local_node} could not start its workers: {text} (is node 0 "
            f"up with --master_addr {plan.master_addr} --master_port {plan.master_port}?)")


def run_local_node(command: Command, plan: LaunchPlan, log_dir: Optional[str]) -> int:
    """This node's workers through torch's elastic agent; 0, or a short report and its code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(list(command.argv[4:]))  # after `python -u -m torch.distributed.run`
    os.environ.update(dict(command.env))
    try:
        with _quiet_torch_elastic():
            run(args)
    except ChildFailedError as error:
        failures = [describe_failure(rank, f.exitcode, f.error_file, log_dir, f.timestamp)
                    for rank, f in error.failures.items()]
        print(format_report(failures), file=sys.stderr)
        code = first_failures(failures)[0].exitcode
        return code if code > 0 else 1
    except SignalException as error:
        print(f"{PROG}: stopped by {error.sigval.name}; the workers were stopped",
              file=sys.stderr)
        return 128 + int(error.sigval)
    except Exception as error:  # rendezvous and store errors: one line, not the agent's
        print(_startup_error(error, plan), file=sys.stderr)
        return 1
    return 0


def _stop(processes: Sequence[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def _recorded_failures(folders: Sequence[Optional[str]], log_dir: Optional[str]
                       ) -> List[RankFailure]:
    found: Dict[int, RankFailure] = {}
    for folder in folders:
        for path in glob.glob(os.path.join(folder, "rank*.error.json")) if folder else []:
            rank = int(os.path.basename(path)[4:].split(".")[0])
            found.setdefault(rank, describe_failure(rank, 1, path, log_dir))
    return list(found.values())


def run_commands(commands: Sequence[Command], log_dir: Optional[str]) -> int:
    """Start every command (pdsh, ssh, mpirun, srun); the first to fail stops the others."""
    with tempfile.TemporaryDirectory(prefix="gigatron-launch-") as error_dir:
        env = {**os.environ, ERROR_DIR_ENV: error_dir}
        processes = [subprocess.Popen(list(c.argv), env={**env, **dict(c.env)},
                                      start_new_session=True) for c in commands]
        try:
            while True:
                codes = [p.poll() for p in processes]
                failed = [i for i, code in enumerate(codes) if code not in (None, 0)]
                if failed or all(code == 0 for code in codes):
                    break
                time.sleep(0.1)
        except KeyboardInterrupt:
            _stop(processes)
            print(f"{PROG}: interrupted; the workers were stopped", file=sys.stderr)
            return 130
        if not failed:
            return 0
        _stop(processes)
        code = processes[failed[0]].returncode
        failures = _recorded_failures([error_dir, log_dir], log_dir)
        if failures:
            print(format_report(failures), file=sys.stderr)
        else:
            print(f"{PROG}: {commands[failed[0]].argv[0]} ({commands[failed[0]].what}) "
                  f"{exit_message(code)}; the other commands were stopped", file=sys.stderr)
        return code if code > 0 else 1
