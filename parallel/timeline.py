"""Horovod's `--timeline` for gigatron: every rank's spans, merged into one Chrome trace.

Turned on by `pretrain_gpt.py --timeline t.json`, by `GIGATRON_TIMELINE=t.json` for any
program that starts through gigatron (pretrain, `gigatron.initialize`, the Horovod API; the
launcher's `--timeline` sets that variable), or by `start(path)`. The trace opens in
ui.perfetto.dev or chrome://tracing: one process row per rank, one row per thread and
"comm (async)" rows for collectives in flight (issue to wait). Spans: data loading, each
micro-batch's forward and backward, every collective and point-to-point batch (bytes, group),
gradient reduction, optimizer step, checkpoint save, evaluation.

Off (the default) it costs one module attribute read (`timeline.on`) where a span could
start: nothing is allocated. On, each span is a tuple in a list (about a microsecond);
the list is appended to this rank's part file (`t.json.parts/rank00003.jsonl`, one JSON
line per batch: about 2 µs a span) every `FLUSH_EVERY` spans, at log intervals and at exit,
so a crashed run leaves its parts (`python -m gigatron.parallel.timeline_merge t.json`
merges them).

One clock: spans are `time.perf_counter_ns()` readings. Ranks on one host share that clock
(CLOCK_MONOTONIC); other hosts are mapped onto rank 0's through reference points taken right
after a world barrier when the timeline starts and when it finishes (linear between them).
`finish()` merges: every rank sends its part to rank 0 (a gather over the world group),
which writes the one trace; without a live process group (at exit) rank 0 merges the part
files it finds. Times are the host's: on a GPU a span ends when its kernels are queued, not
run (use torch.profiler for device time).
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import sys
import threading
import time
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

on = False  # the one flag the hot paths read: `if timeline.on:`
ENV = "GIGATRON_TIMELINE"
FLUSH_EVERY = 20000  # spans kept in memory before they are appended to the part file
ASYNC = "comm (async)"  # the row kind of collectives in flight (lanes are made at merge)
now = time.perf_counter_ns  # the clock of every span (ns)

# (what: "all_reduce over dp group [0, 2]", bytes, start ns) of a collective being issued
Token = Tuple[str, int, int]
_NULL: ContextManager[None] = contextlib.nullcontext()


class _Recorder:
    """This rank's spans and their part file."""

    def __init__(self, path: str, rank: int, world_size: int) -> None:
        self.path, self.rank, self.world_size = path, rank, world_size
        self.part = part_path(path, rank)
        self.events: List[tuple] = []  # (row, name, start ns, end ns, args or None)
        self.rows: Dict[int, str] = {}  # thread ident -> row name
        os.makedirs(os.path.dirname(self.part) or ".", exist_ok=True)
        self._write([{"part": 1, "rank": rank, "world_size": world_size,
                      "host": socket.gethostname(), "pid": os.getpid()}], "w")

    def row(self) -> str:
        ident = threading.get_ident()
        name = self.rows.get(ident)
        if name is None:
            thread = threading.current_thread()
            name = "main thread" if thread is threading.main_thread() else thread.name
            self.rows[ident] = name
        return name

    def add(self, row: str, name: str, start: int, end: int, args: Optional[dict]) -> None:
        self.events.append((row, name, start, end, args))
        if len(self.events) >= FLUSH_EVERY:
            self.flush()

    def flush(self, extra: Tuple[dict, ...] = ()) -> None:
        events, self.events = self.events, []
        self._write(([{"spans": events}] if events else []) + list(extra), "a")

    def _write(self, lines: List[Any], mode: str) -> None:
        with open(self.part, mode) as f:
            f.write("".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines))


_rec: Optional[_Recorder] = None
_atexit_registered = False


def part_path(path: str, rank: int) -> str:
    """Where rank `rank` keeps its spans while the run goes: next to the trace."""
    return os.path.join(path + ".parts", f"rank{rank:05d}.jsonl")


# -- recording (cheap; callers check `on` first where it matters) ---------------------------
def record(name: str, start: int, args: Optional[dict] = None) -> None:
    """A span on this thread's row from `start` (a `now()` reading) to now."""
    rec = _rec
    if rec is not None:
        rec.add(rec.row(), name, start, now(), args)


def span(name: str) -> ContextManager[None]:
    """`with timeline.span("checkpoint save"):` -- a shared no-op context when off."""
    return _span(name) if on else _NULL


@contextlib.contextmanager
def _span(name: str) -> Iterator[None]:
    start = now()
    try:
        yield
    finally:
        record(name, start)


def issue(what: str, nbytes: float) -> Token:
    """A collective is being issued (`what`: comm's activity line, 'op over group')."""
    return what, int(nbytes), now()


def complete(token: Token, work: Any) -> Any:
    """After the collective call: a blocking one (`work` None) becomes a span on this
    thread; an async handle is returned wrapped so that its `wait()` ends the span."""
    if work is None:
        _add_collective(token, None)
        return None
    return _TimedWork(work, token, [1])


def complete_all(token: Token, works: List[Any]) -> List[Any]:
    """A batch of point-to-point requests: one span, ended when all are waited on."""
    pending = [len(works)]
    return [_TimedWork(w, token, pending) for w in works]


def _add_collective(token: Token, row: Optional[str]) -> None:
    rec = _rec
    if rec is None:
        return
    what, nbytes, start = token
    name, _, group = what.partition(" over ")
    rec.add(rec.row() if row is None else row, name, start, now(),
            {"bytes": nbytes, "group": group})


class _TimedWork:
    """An async collective's handle whose wait() ends its span (the rest passes through)."""

    __slots__ = ("_work", "_token", "_pending")

    def __init__(self, work: Any, token: Token, pending: List[int]) -> None:
        self._work, self._pending = work, pending
        self._token: Optional[Token] = token  # None once its span is recorded

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        result = self._work.wait(*args, **kwargs)
        token = self._token
        if token is not None:
            self._token = None
            self._pending[0] -= 1
            if self._pending[0] == 0:
                _add_collective(token, ASYNC)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


# -- starting and finishing ----------------------------------------------------------------
def _where() -> Tuple[int, int, bool]:
    """(rank, world size, whether a process group is up)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), True
    from gigatron.parallel.world import read_launch_env

    launch = read_launch_env()
    return launch.rank, launch.world_size, False


def start(path: str, label: Optional[str] = None) -> None:
    """Start recording to `path` (every rank calls it; collective when a group is up)."""
    global on, _rec, _atexit_registered
    if _rec is not None and _rec.path == path:
        if label is not None:
            name_process(label)
        return
    rank, world_size, grouped = _where()
    _rec = _Recorder(path, rank, world_size)
    name_process(label or f"rank {rank}")
    _reference(_rec, grouped)
    on = True
    if not _atexit_registered:
        atexit.register(_finish_at_exit)
        _atexit_registered = True


def start_from_env(label: Optional[str] = None) -> bool:
    """`start($GIGATRON_TIMELINE)` when the variable is set; returns whether it runs."""
    path = os.environ.get(ENV)
    if path:
        start(path, label)
    return _rec is not None


def name_process(label: str) -> None:
    """This rank's row title in the trace: 'rank 3 (tp 1, pp 0, dp 1)'."""
    if _rec is not None:
        _rec.flush(({"label": label},))


def flush() -> None:
    """Append what was recorded to this rank's part file (log intervals call it)."""
    if _rec is not None:
        _rec.flush()


def _reference(rec: _Recorder, grouped: bool) -> None:
    """A clock reference point right after a world barrier (the same instant on every rank,
    within the barrier's release skew); the n-th points of all ranks are paired."""
    if grouped and rec.world_size > 1:
        import torch.distributed as dist

        for _ in range(2):  # the first may set up connections; the second is tight
            dist.barrier()
    rec.flush(({"ref": now()},))


def finish(collective: bool = True) -> Optional[str]:
    """Stop recording and merge. `collective`: every rank calls it with the process group
    alive (pretrain's normal end): the parts go to rank 0 by a gather. Otherwise (at exit,
    after a failure) each rank completes its part file and rank 0 merges the files it
    finds. Returns the trace's path on the rank that wrote it, else None."""
    global on, _rec
    rec = _rec
    if rec is None:
        return None
    on, _rec = False, None
    grouped = _where()[2]
    if collective and grouped:
        _reference(rec, True)
    rec.flush(({"end": True},))
    from gigatron.parallel import timeline_merge

    if collective and grouped:
        return timeline_merge.gather_and_write(rec.path, rec.part, rec.rank)
    if rec.rank != 0:
        return None
    return timeline_merge.merge_files(rec.path, rec.world_size, wait_s=_wait_seconds())


def _finish_at_exit() -> None:
    """A program that never called finish (the engine's, Horovod's): merge from the files."""
    path = finish(collective=False)
    if path is not None:
        print(f"gigatron timeline: {os.path.abspath(path)} (open it in ui.perfetto.dev)",
              file=sys.stderr, flush=True)


def _wait_seconds() -> float:
    """How long rank 0 waits at exit for the other ranks' parts to be complete."""
    try:
        return float(os.environ.get("GIGATRON_TIMELINE_WAIT_S", "10"))
    except ValueError:
        print("gigatron timeline: GIGATRON_TIMELINE_WAIT_S is not a number; waiting 10 s",
              file=sys.stderr)
        return 10.0
