"""One rank of a `gigatron launch` job: the same start-up under torchrun, mpirun and srun.

`python -u -m gigatron.parallel.launcher.worker [--no_local_rank] [--log_dir D] script.py ARGS`
(or `... worker gigatron COMMAND ARGS`)

- reads this rank's place the way `gigatron.parallel.world` does (torchrun, SLURM or MPI
  variables) and exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
  MASTER_PORT, plus DeepSpeed's LOCAL_SIZE, CROSS_RANK (node index) and CROSS_SIZE (nodes),
  so a script written for torchrun runs under mpirun or srun unchanged;
- with --log_dir, sends this rank's stdout and stderr to D/rank{RANK}.log (DeepSpeed's
  per-rank logs: the console keeps only the launcher's lines);
- runs the script as `__main__` with `--local_rank=K` before its arguments (DeepSpeed's
  convention) unless --no_local_rank; a script name not found in the working directory is
  looked up where pip installs scripts for this Python, then on PATH (`pretrain_gpt.py` from
  any folder); `gigatron` (or a path ending in it, `$(which gigatron)`) runs the gigatron
  command in this Python, without --local_rank (its commands read LOCAL_RANK);
- an uncaught exception prints its traceback as Python would (without this module's frames;
  one whose type sets `report_without_traceback`, gigatron's ConfigError, prints its message
  alone) and is recorded where the launcher reads it: the error file torch's elastic agent names
  (TORCHELASTIC_ERROR_FILE) and D/rank{RANK}.error.json for D in --log_dir and
  GIGATRON_LAUNCH_ERROR_DIR.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import sysconfig
import time
import traceback
from types import TracebackType
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from gigatron.parallel.world import read_launch_env, restart_count

ERROR_DIR_ENV = "GIGATRON_LAUNCH_ERROR_DIR"
LOG_DIR_ENV = "GIGATRON_LAUNCH_LOG_DIR"  # --log_dir, for error records written outside main


def _first_int(env: Mapping[str, str], *names: str) -> Optional[int]:
    for name in names:
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def rank_env(env: Mapping[str, str]) -> Dict[str, str]:
    """The torchrun-style variables of this rank, from whichever launcher started it."""
    launch = read_launch_env(env)
    nodes = _first_int(env, "GROUP_WORLD_SIZE", "SLURM_NNODES", "CROSS_SIZE")
    local_size = _first_int(env, "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                            "MPI_LOCALNRANKS", "LOCAL_SIZE")
    if local_size is None:
        local_size = launch.world_size // nodes if nodes else launch.world_size
    node = _first_int(env, "GROUP_RANK", "SLURM_NODEID", "CROSS_RANK")
    return {"RANK": str(launch.rank), "WORLD_SIZE": str(launch.world_size),
            "LOCAL_RANK": str(launch.local_rank), "LOCAL_WORLD_SIZE": str(local_size),
            "LOCAL_SIZE": str(local_size), "MASTER_ADDR": launch.master_addr,
            "MASTER_PORT": str(launch.master_port),
            "CROSS_RANK": str(node if node is not None else launch.rank // max(local_size, 1)),
            "CROSS_SIZE": str(nodes or max(launch.world_size // max(local_size, 1), 1))}


def parse_worker_args(argv: Sequence[str]) -> Tuple[bool, Optional[str], List[str]]:
    """(no_local_rank, log_dir, [script, args...]): our options end at the script path."""
    args, no_local_rank, log_dir = list(argv), False, None
    while args and args[0].startswith("--"):
        option = args.pop(0)
        if option == "--no_local_rank":
            no_local_rank = True
        elif option == "--log_dir" and args:
            log_dir = args.pop(0)
        else:
            raise SystemExit(f"gigatron launch worker: unknown option {option!r} before the "
                             f"script (options: --no_local_rank, --log_dir D)")
    if not args:
        raise SystemExit("gigatron launch worker: no script given")
    return no_local_rank, log_dir, args


def _redirect_output(path: str, restart: int = 0) -> None:
    """This rank's output to `path`: a new log, or after a restart the same one continued
    (the failed attempt's lines stay readable above the restart)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fresh = os.O_TRUNC if restart == 0 else 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | fresh | os.O_APPEND, 0o644)
    if restart:
        os.write(fd, f"---- gigatron launch: restart {restart} ----\n".encode())
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


GIGATRON_COMMAND = "gigatron"


def is_gigatron_command(script: str) -> bool:
    """`gigatron`, or a path to it (`$(which gigatron)`, maybe a pyenv shell shim): the
    command, run in the rank's own Python."""
    return os.path.basename(script) == GIGATRON_COMMAND


def _is_python(path: str) -> bool:
    """A Python script: a python shebang, or a .py file without another shebang (pyenv's
    shims are bash scripts named like the script they start)."""
    with open(path, "rb") as f:
        first = f.readline(256)
    return b"python" in first if first.startswith(b"#!") else path.endswith(".py")


def find_script(script: str) -> Optional[str]:
    """The Python file `script` names: the path as given, else (a bare name) the script pip
    installed next to this Python (`pretrain_gpt.py`), else one on PATH; None if none."""
    if os.path.isfile(script) or os.sep in script:
        return script if os.path.isfile(script) and _is_python(script) else None
    folders = [sysconfig.get_path("scripts")] + os.environ.get("PATH", "").split(os.pathsep)
    for folder in folders:
        path = os.path.join(folder, script)
        if folder and os.path.isfile(path) and _is_python(path):
            return path
    return None


def script_not_found(script: str) -> str:
    """The one line for a script `find_script` cannot find."""
    if os.path.isfile(script):
        return (f"script {script!r} is not a Python script (a shell wrapper?): give the "
                f"Python file, or `gigatron COMMAND` for the gigatron command")
    where = f"in {os.getcwd()}" if os.sep in script else \
        f"in {os.getcwd()}, in {sysconfig.get_path('scripts')} or on PATH"
    return (f"script {script!r} not found {where}: give its path (the gigatron command: "
            f"`gigatron launch ... gigatron pretrain ...`)")


def _user_frames(tb: Optional[TracebackType], script: Optional[str]) -> Optional[TracebackType]:
    """The traceback from the script's first frame on: this module and runpy cut off, and
    nothing when the script never ran (a SyntaxError shows its own line); for the gigatron
    command (script None), from its first frame outside this module and runpy."""
    start = tb
    if script is None:
        ours = {os.path.realpath(__file__), os.path.realpath(runpy.__file__)}
        while start is not None and os.path.realpath(start.tb_frame.f_code.co_filename) in ours:
            start = start.tb_next
        return start
    target = os.path.realpath(script)
    while start is not None and os.path.realpath(start.tb_frame.f_code.co_filename) != target:
        start = start.tb_next
    return start


def record_failure(error: BaseException, callstack: str, paths: Sequence[str]) -> None:
    """Write the failure in the error-file format torch's elastic agent reads."""
    now = time.time()
    data = {"message": {"message": f"{type(error).__name__}: {error}",
                        "extraInfo": {"py_callstack": callstack, "timestamp": str(int(now)),
                                      "time": now}}}
    for path in paths:
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass  # the report is a courtesy: the traceback is on stderr already


def _error_paths(rank: str, log_dir: Optional[str]) -> List[str]:
    paths = [os.environ["TORCHELASTIC_ERROR_FILE"]] if os.environ.get(
        "TORCHELASTIC_ERROR_FILE") else []
    for folder in (log_dir, os.environ.get(ERROR_DIR_ENV), os.environ.get(LOG_DIR_ENV)):
        if folder:
            paths.append(os.path.join(folder, f"rank{rank}.error.json"))
    return sorted(set(paths), key=paths.index)


class WatchdogVerdict(RuntimeError):
    """The watchdog ended the job: its verdict names the hung or stuck rank."""


def record_verdict(message: str) -> None:
    """Leave the watchdog's verdict as this rank's error record (where torch's agent and
    `gigatron launch` read a failed rank's reason), so that the launcher's report and its
    restart line name the hang, not the SIGKILL that ended the hung rank."""
    rank = os.environ.get("RANK")
    if rank is not None:
        record_failure(WatchdogVerdict(message), "", _error_paths(rank, None))


def run_script(script: Optional[str], args: Sequence[str], error_paths: Sequence[str]) -> int:
    """Run `script` as __main__ the way `python script.py args` would (None: the gigatron
    command, as `gigatron args` would); 1 on an exception."""
    sys.argv = [script or GIGATRON_COMMAND, *args]
    if script is not None:
        sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        if script is None:
            runpy.run_module(GIGATRON_COMMAND, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:
        if getattr(error, "report_without_traceback", False):  # a user's error, said whole
            if os.environ.get("RANK", "0") == "0":  # every rank finds it: the launcher's
                print(f"{sys.argv[0]}: error: {error}", file=sys.stderr, flush=True)  # report
            record_failure(error, "", error_paths)  # names another rank's own
            return 1
        tb = _user_frames(error.__traceback__, script)
        text = "".join(traceback.format_exception(type(error), error, tb))
        sys.stderr.write(text)
        sys.stderr.flush()
        record_failure(error, text, error_paths)
        return 1
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Set up this rank's environment and logs, then run the script."""
    no_local_rank, log_dir, (script, *args) = parse_worker_args(
        sys.argv[1:] if argv is None else argv)
    try:
        os.environ.update(rank_env(os.environ))
    except ValueError as error:
        print(f"gigatron launch worker: {error}", file=sys.stderr)
        return 2
    command = is_gigatron_command(script)
    found = None if command else find_script(script)
    if not command and found is None:
        print(f"gigatron launch worker: {script_not_found(script)}", file=sys.stderr)
        return 2
    rank = os.environ["RANK"]
    if log_dir:
        os.environ[LOG_DIR_ENV] = log_dir
        _redirect_output(os.path.join(log_dir, f"rank{rank}.log"), restart_count())
    if not (no_local_rank or command):
        args = [f"--local_rank={os.environ['LOCAL_RANK']}", *args]
    return run_script(found, args, _error_paths(rank, log_dir))


if __name__ == "__main__":
    sys.exit(main())
