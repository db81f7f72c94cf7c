"""What this rank is doing right now, for the watchdog's heartbeat and hang reports.

Updated by the collectives in `comm` (which op, over which group), by the training loop
(iteration and phase) and by the data iterator (while it waits for the data loader, and on
which worker processes); read by the watchdog thread a few times a minute. Updating is a few
attribute stores, cheap enough for every collective and every batch.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, Optional, Sequence, Tuple, TypeVar

T = TypeVar("T")

WAITING_FOR_DATA = "waiting for its data loader"


class Activity:
    """Iteration, phase (and since when) and the last collective this process entered."""

    def __init__(self) -> None:
        self.iteration: Optional[int] = None
        self.phase = "starting"
        self.phase_since = time.monotonic()
        self.waiting_on: Tuple[int, ...] = ()  # pids of the processes the phase waits for
        self.collective: Optional[str] = None
        self.since = time.monotonic()
        self._labels: Dict[int, str] = {}

    def label_group(self, group: Any, label: str) -> None:
        """Name a process group in reports ('dp [0, 2, 4, 6]')."""
        self._labels[id(group)] = label

    def at(self, iteration: Optional[int], phase: str) -> None:
        self.iteration, self.phase, self.phase_since = iteration, phase, time.monotonic()

    @contextmanager
    def waiting(self, phase: str, pids: Sequence[int] = ()) -> Iterator[None]:
        """Within the block this rank is in `phase`, waiting on processes `pids` (none: on
        its own work); the phase before it is restored after, with its clock."""
        before = self.phase, self.phase_since, self.waiting_on
        self.phase, self.phase_since, self.waiting_on = phase, time.monotonic(), tuple(pids)
        try:
            yield
        finally:
            self.phase, self.phase_since, self.waiting_on = before

    def phase_seconds(self) -> float:
        """How long this rank has been in its current phase."""
        return time.monotonic() - self.phase_since

    def entered(self, op: str, group: Any, size: int) -> None:
        """A collective (or point-to-point batch) was issued over `group`."""
        where = self._labels.get(id(group), "world" if group is None else f"{size} ranks")
        self.collective, self.since = f"{op} over {where}", time.monotonic()

    def describe(self) -> str:
        """'iteration 7, train step, last collective all_reduce over dp [0, 2] (3 s ago)'."""
        parts = [] if self.iteration is None else [f"iteration {self.iteration}"]
        parts.append(self.phase if self.phase != WAITING_FOR_DATA
                     else f"{self.phase} for {self.phase_seconds():.0f} s")
        if self.collective is not None:
            parts.append(f"last collective {self.collective} "
                         f"({time.monotonic() - self.since:.0f} s ago)")
        return ", ".join(parts)


activity = Activity()  # process-wide, like comm.stats


def waited_for(loader: Iterable[T]) -> Iterator[T]:
    """The loader's batches, each wait for one marked in `activity` with the pids of the
    loader's worker processes: the watchdog names a rank whose loader stops delivering."""
    batches = iter(loader)
    # torch keeps a multi-process iterator's worker processes in `_workers` (none with
    # num_workers=0, where the training process reads the samples itself)
    pids = [w.pid for w in getattr(batches, "_workers", ())]
    while True:
        with activity.waiting(WAITING_FOR_DATA, pids):
            try:
                batch = next(batches)
            except StopIteration:
                return
        yield batch
