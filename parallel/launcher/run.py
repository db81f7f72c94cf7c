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
from typing import Dict, List, Optional, Sequence

from .commands import Command
from .failures import PROG, RankFailure, describe_failure, exit_message, format_report
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


def run_commands(commands: Sequence[Command], log_dir: Optional[str],
                 ranks_report: bool) -> int:
    """Start every command (pdsh, ssh, mpirun, srun); the first to fail stops the others.

    `ranks_report`: the commands start the ranks themselves (mpirun, srun), so the launcher
    names the failed rank; pdsh/ssh nodes run the node module, which reports it already.
    """
    with tempfile.TemporaryDirectory(prefix="gigatron-launch-") as error_dir:
        env = {**os.environ, ERROR_DIR_ENV: error_dir} if ranks_report else dict(os.environ)
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
        failures = _recorded_failures([error_dir, log_dir], log_dir) if ranks_report else []
        if failures:
            print(format_report(failures), file=sys.stderr)
        else:
            print(f"{PROG}: {commands[failed[0]].what}: {exit_message(code)}"
                  + ("; the other commands were stopped" if len(commands) > 1 else ""),
                  file=sys.stderr)
        return code if code > 0 else 1
