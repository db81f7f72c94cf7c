"""--async-save: a torch_dist save written by a background thread while training goes on.

The state is first copied to CPU memory (staging: training may change the parameters as
soon as `start` returns), except an offloaded optimizer's host masters and moments, which
the thread reads where they are while the next optimizer step waits for it (`join`,
ZeroOptimizer.hold_step: their copy would be 12 B/param more on the host). The thread then
runs the same save as a synchronous one (dist_checkpoint.save: DCP's write, the checksums,
the agreement of all ranks, rank 0 publishing the folder and only then the tracker) over a
process group of its own (gloo, so it never shares a communicator with training's
collectives). The tracker therefore names
the new iteration only once every rank's part is on disk. `wait` joins the thread; the
next save and the end of training call it, so at most one save is pending, and a failed
background save raises its error there, on every rank alike.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist


@dataclass
class SavedCheckpoint:
    """A finished save, for the log line."""

    iteration: int
    folder: str
    seconds: float  # from the call to save until the files were published
    background: bool = False


@dataclass
class _Pending:
    iteration: int
    started: float
    thread: threading.Thread
    folder: Optional[str] = None
    error: Optional[BaseException] = None
    finished: float = field(default=0.0)


class AsyncSaver:
    """At most one save in flight; its own process group, created at the first save."""

    def __init__(self) -> None:
        self._pending: Optional[_Pending] = None
        self._group: Any = None

    def group(self, timeout_minutes: float) -> Any:
        """The save's process group (collective: every rank creates it at the same save)."""
        if self._group is None and dist.is_available() and dist.is_initialized():
            self._group = dist.new_group(backend="gloo",
                                         timeout=timedelta(minutes=timeout_minutes))
        return self._group

    def start(self, iteration: int, started: float, write: Callable[[], str]) -> None:
        """Run `write` (returns the published folder) in the background."""
        if self._pending is not None:
            raise RuntimeError("a checkpoint save is still pending: wait() for it first")

        def run() -> None:
            try:
                pending.folder = write()
            except BaseException as err:  # re-raised by wait() in the training thread
                pending.error = err
            pending.finished = time.perf_counter()

        pending = _Pending(iteration, started, threading.Thread(
            target=run, name=f"checkpoint-save-{iteration}", daemon=True))
        self._pending = pending
        pending.thread.start()

    def join(self) -> None:
        """Block until the pending save (if any) is written; its result and error stay for
        `wait`."""
        if self._pending is not None:
            self._pending.thread.join()

    def wait(self) -> Optional[SavedCheckpoint]:
        """Block until the pending save (if any) finished; raises its error."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        pending.thread.join()
        if pending.error is not None:
            raise pending.error
        assert pending.folder is not None  # the thread finished without an error
        return SavedCheckpoint(pending.iteration, pending.folder,
                               pending.finished - pending.started, background=True)
