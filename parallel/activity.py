"""What this rank is doing right now, for the watchdog's heartbeat and hang reports.

Updated by the collectives in `comm` (which op, over which group) and by the training loop
(iteration and phase); read by the watchdog thread a few times a minute. Updating is a few
attribute stores, cheap enough for every collective.
"""
from __future__ import annotations

import time
from typing import Any, Dict, Optional


class Activity:
    """Iteration, phase and the last collective this process entered."""

    def __init__(self) -> None:
        self.iteration: Optional[int] = None
        self.phase = "starting"
        self.collective: Optional[str] = None
        self.since = time.monotonic()
        self._labels: Dict[int, str] = {}

    def label_group(self, group: Any, label: str) -> None:
        """Name a process group in reports ('dp [0, 2, 4, 6]')."""
        self._labels[id(group)] = label

    def at(self, iteration: Optional[int], phase: str) -> None:
        self.iteration, self.phase = iteration, phase

    def entered(self, op: str, group: Any, size: int) -> None:
        """A collective (or point-to-point batch) was issued over `group`."""
        where = self._labels.get(id(group), "world" if group is None else f"{size} ranks")
        self.collective, self.since = f"{op} over {where}", time.monotonic()

    def describe(self) -> str:
        """'iteration 7, train step, last collective all_reduce over dp [0, 2] (3 s ago)'."""
        parts = [] if self.iteration is None else [f"iteration {self.iteration}"]
        parts.append(self.phase)
        if self.collective is not None:
            parts.append(f"last collective {self.collective} "
                         f"({time.monotonic() - self.since:.0f} s ago)")
        return ", ".join(parts)


activity = Activity()  # process-wide, like comm.stats
