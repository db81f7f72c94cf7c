"""Named wall-clock timers for the step's phases: forward, backward, comm, optimizer.

The executor runs forward, backward and communication interleaved, so the phases are
measured where they happen: forward by hooks around every model chunk's forward, comm by
wrapping the pipeline's p2p and the gradient sync's `finish_sync`, the optimizer around
its step; backward is the step's remaining time. On CPU the numbers are exact; on an
accelerator the boundaries synchronise the device only at --timing-log-level >= 1 (else
they measure host time, which is cheap but only indicative).
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils.hooks import RemovableHandle

from gigatron.parallel.pipeline.executor import PointToPoint
from gigatron.parallel.pipeline.interfaces import GradSync


class Timers:
    """Accumulates seconds per name between `reset()` calls."""

    def __init__(self, sync: Optional[Callable[[], None]] = None) -> None:
        self.sync = sync
        self.elapsed: Dict[str, float] = defaultdict(float)
        self._start: Dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.sync is not None:
            self.sync()
        self.elapsed[name] += time.perf_counter() - self._start.pop(name)

    def reset(self) -> Dict[str, float]:
        """Seconds per name since the last reset; starts a new interval."""
        out = dict(self.elapsed)
        self.elapsed.clear()
        return out


def device_sync(device: torch.device) -> Optional[Callable[[], None]]:
    """A synchronise function for accelerators (None on CPU, where work is synchronous)."""
    if device.type == "cpu":
        return None
    return torch.accelerator.synchronize


def time_module_forward(module: torch.nn.Module, timers: Timers,
                        name: str = "forward") -> Tuple[RemovableHandle, RemovableHandle]:
    """Time every forward of `module` (hooks); returns the hook handles."""
    return (module.register_forward_pre_hook(lambda *_: timers.start(name)),
            module.register_forward_hook(lambda *_: timers.stop(name)))


class TimedP2P:
    """The pipeline's p2p (a `PointToPoint`) with its transfers timed as 'comm'."""

    def __init__(self, p2p: PointToPoint, timers: Timers) -> None:
        self._p2p, self._timers = p2p, timers

    def communicate(self, sends: Sequence[Tuple[torch.Tensor, int]],
                    recv_from: Sequence[int]) -> List[torch.Tensor]:
        self._timers.start("comm")
        try:
            return self._p2p.communicate(sends, recv_from)
        finally:
            self._timers.stop("comm")


class TimedGradSync:
    """A `GradSync` with the end-of-step wait for its reductions timed as 'comm'."""

    def __init__(self, grad_sync: GradSync, timers: Timers) -> None:
        self._sync, self._timers = grad_sync, timers

    def enable_sync(self, chunk: int, enabled: bool) -> None:
        self._sync.enable_sync(chunk, enabled)

    def finish_sync(self) -> None:
        self._timers.start("comm")
        try:
            self._sync.finish_sync()
        finally:
            self._timers.stop("comm")
