"""One node's workers through torch's elastic agent, with a short report when one fails.

`python -u -m gigatron.parallel.launcher.node TORCHRUN_FLAGS -m gigatron.parallel.launcher.worker
script args` takes torchrun's flags and runs `torch.distributed.run` with them in this
process (torch does the rendezvous, the environment and stopping the other workers when one
fails); it catches the agent's ChildFailedError and prints a few lines naming the failed rank
instead of the agent's traceback. `gigatron launch` runs this node's part with it, and each
node's pdsh/ssh command runs this module.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from gigatron.parallel.world import RESTART_COUNT_ENV

from .commands import WORKER_MODULE
from .failures import (PROG, RankFailure, describe_failure, first_failures, format_report,
                       gave_up_line, restart_line)
from .progress import PROGRESS_DIR_ENV, read_progress
from .worker import parse_worker_args


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


def _startup_error(error: BaseException, args: Any) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if "EADDRINUSE" in str(error) or "address already in use" in str(error):
        return (f"{PROG}: --master_port {args.master_port} is in use on this machine: pick "
                f"another port (every node must use the same)")
    return (f"{PROG}: node {args.node_rank} could not start its workers: {text} (is node 0 "
            f"up with --master_addr {args.master_addr} --master_port {args.master_port}?)")


def _log_dir(args: Any) -> Optional[str]:
    """The worker's --log_dir, where the failed rank's log is."""
    if not (args.module and args.training_script == WORKER_MODULE):
        return None
    try:
        return parse_worker_args(args.training_script_args)[1]
    except SystemExit:
        return None


def _run_once(args: Any) -> Tuple[int, Optional[List[RankFailure]]]:
    """One attempt of torch's agent: (exit code, the ranks that failed; None when the
    failure is not a rank's: a signal to the launcher, a rendezvous or store error)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    try:
        with _quiet_torch_elastic():
            run(args)
    except ChildFailedError as error:
        failures = [describe_failure(rank, f.exitcode, f.error_file, _log_dir(args),
                                     f.timestamp) for rank, f in error.failures.items()]
        code = first_failures(failures)[0].exitcode
        return (code if code > 0 else 1), failures
    except SignalException as error:
        print(f"{PROG}: stopped by {error.sigval.name}; the workers were stopped",
              file=sys.stderr)
        return 128 + int(error.sigval), None
    except Exception as error:  # rendezvous and store errors: one line, not the agent's
        print(_startup_error(error, args), file=sys.stderr)
        return 1, None
    return 0, None


def run_node(torchrun_args: Sequence[str]) -> int:
    """torchrun with these flags, here; 0, or a short report and the failed rank's code.

    torchrun's --max-restarts N is ours: each restart is a fresh agent (a fresh rendezvous
    and store) after one line naming the failure and the iterations it costs.
    """
    from torch.distributed.run import parse_args

    restarts = parse_args(list(torchrun_args)).max_restarts
    with tempfile.TemporaryDirectory(prefix="gigatron-progress-") as progress_dir:
        os.environ[PROGRESS_DIR_ENV] = progress_dir
        for attempt in range(restarts + 1):
            os.environ[RESTART_COUNT_ENV] = str(attempt)
            args = parse_args(list(torchrun_args))  # torch fills some in (run id)
            args.max_restarts = 0
            code, failures = _run_once(args)
            if not failures:
                return code
            if attempt == restarts:
                print(format_report(failures), file=sys.stderr)
                if restarts:
                    print(gave_up_line(restarts), file=sys.stderr)
                return code
            failed = format_report(failures, stopped_others=False).splitlines()[0]
            print(restart_line(failed, attempt + 1, restarts, read_progress(progress_dir)),
                  file=sys.stderr)
    return 1  # not reached: the last attempt returns


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m gigatron.parallel.launcher.node TORCHRUN_FLAGS ...`."""
    return run_node(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
