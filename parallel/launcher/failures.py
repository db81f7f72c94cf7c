"""What the launcher says when ranks fail: the first one, why, and its last error lines.

Read from the error file a rank's worker wrote (torch's elastic error-file format, with a
sub-second time added) or, for a rank that left none, from its exit code and log tail.
"""
from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .progress import iterations_lost

PROG = "gigatron launch"
TAIL_LINES = 6  # of a rank's log when it left no traceback
TRACEBACK_LINES = 3  # the failing line and the exception: the rest is on stderr above
VERDICT_PREFIX = "WatchdogVerdict: "  # a record worker.record_verdict left


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
    (SIGTERM, no error recorded: the tail of their log does not count) because another had
    failed. A rank killed by a signal comes before ranks that raised: their collectives
    fail because it died, and the agent times its death in whole seconds only."""
    def stopped(f: RankFailure) -> bool:
        return f.exitcode == -signal.SIGTERM and f.message == exit_message(f.exitcode)

    own = [f for f in failures if not stopped(f)]
    return sorted(own or failures,
                  key=lambda f: (not is_verdict(f), f.exitcode >= 0, f.when, f.rank))


def is_verdict(failure: RankFailure) -> bool:
    """The watchdog's verdict (a hung rank, a stuck data loader): the cause, ahead of the
    SIGKILL it sent the hung rank and the collectives that failed meanwhile."""
    return failure.message.startswith(VERDICT_PREFIX)


def format_report(failures: Sequence[RankFailure], stopped_others: bool = True) -> str:
    """A few lines: the first failed rank, why, its last error lines, where its log is."""
    failures = first_failures(failures)
    first = failures[0]
    others = sorted(f.rank for f in failures if f is not first)
    head = f"{PROG}: rank {first.rank} failed ({first.message})" if not is_verdict(first) \
        else f"{PROG}: {first.message[len(VERDICT_PREFIX):]}"
    if stopped_others:
        head += "; the other ranks were stopped"
    lines = [head] + [f"  | {line}" for line in first.lines]
    if first.log:
        lines.append(f"  its log: {first.log}")
    if others:
        lines.append(f"  rank(s) {', '.join(map(str, others))} failed as well")
    return "\n".join(lines)




def restart_line(failed: str, restart: int, restarts: int, progress: Mapping[str, int]
                 ) -> str:
    """The one line of a restart: what failed (a report's first line), the count, and the
    iterations it costs."""
    return (f"{failed}; restart {restart} of {restarts} from the latest checkpoint: "
            f"{iterations_lost(progress)}")


def gave_up_line(restarts: int) -> str:
    """After the last allowed restart failed too."""
    return (f"{PROG}: no restart left after {restarts} (--max_restarts {restarts}): "
            f"the failure above ends the job")
