"""Start the commands of a multi-node or MPI/SLURM launch; the first to fail stops the rest.

pdsh, ssh (one per node), mpirun and srun run as child processes in their own sessions. A
failed rank is named from the error records its worker left (in --log_dir, or in a
temporary folder the local ranks share through GIGATRON_LAUNCH_ERROR_DIR).
"""
from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

from gigatron.parallel.world import RESTART_COUNT_ENV

from .commands import Command
from .failures import (PROG, RankFailure, describe_failure, exit_message, format_report,
                       gave_up_line, restart_line)
from .progress import PROGRESS_DIR_ENV, read_progress
from .worker import ERROR_DIR_ENV

STOP_GRACE_SECONDS = 5.0


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


def _run_once(commands: Sequence[Command], env: Dict[str, str]
              ) -> Optional[Tuple[int, subprocess.Popen]]:
    """Start the commands and wait: None when all succeed, else (index of the first that
    failed, its process) once the others are stopped; KeyboardInterrupt stops them."""
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
        raise
    if not failed:
        return None
    _stop(processes)
    return failed[0], processes[failed[0]]


def run_commands(commands: Sequence[Command], log_dir: Optional[str],
                 ranks_report: bool, max_restarts: int = 0) -> int:
    """Start every command (pdsh, ssh, mpirun, srun); the first to fail stops the others.

    `ranks_report`: the commands start the ranks themselves (mpirun, srun), so the launcher
    names the failed rank; pdsh/ssh nodes run the node module, which reports it already.
    `max_restarts`: start every command again after a failure, up to that many times.
    """
    with tempfile.TemporaryDirectory(prefix="gigatron-launch-") as error_dir:
        env = {**os.environ, PROGRESS_DIR_ENV: error_dir}
        if ranks_report:
            env[ERROR_DIR_ENV] = error_dir
        for attempt in range(max_restarts + 1):
            env[RESTART_COUNT_ENV] = str(attempt)
            for folder in [f for f in (error_dir, log_dir) if f and attempt]:
                for old in glob.glob(os.path.join(folder, "rank*.error.json")):
                    os.remove(old)  # the previous attempt's records
            try:
                failed = _run_once(commands, env)
            except KeyboardInterrupt:
                print(f"{PROG}: interrupted; the workers were stopped", file=sys.stderr)
                return 130
            if failed is None:
                return 0
            index, process = failed
            failures = _recorded_failures([error_dir, log_dir], log_dir) if ranks_report \
                else []
            code = process.returncode
            what = format_report(failures) if failures else \
                f"{PROG}: {commands[index].what}: {exit_message(code)}" + (
                    "; the other commands were stopped" if len(commands) > 1 else "")
            if attempt < max_restarts:
                print(restart_line(what.splitlines()[0], attempt + 1, max_restarts,
                                   read_progress(error_dir)), file=sys.stderr)
                continue
            print(what, file=sys.stderr)
            if max_restarts:
                print(gave_up_line(max_restarts), file=sys.stderr)
            return code if code > 0 else 1
    return 1  # not reached: the last attempt returns
