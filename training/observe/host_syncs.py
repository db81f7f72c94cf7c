"""Count host synchronisations: places where gigatron code makes the CPU wait for a tensor.

A read of a tensor's value into Python (`item`, `tolist`, `numpy`, `bool(t)`, `float(t)`,
`int(t)`, `operator.index(t)`, formatting) and an explicit `torch.cuda/accelerator.synchronize`
block the host until the device has computed that value. Inside `with HostSyncCounter() as
c:` these are patched to count, with the file and line of the reading code in `c.sites`.

Reads made by torch itself are not counted (the caller's frame is inside torch): torch.optim's
non-capturable Adam reads its step counters, which torch keeps on the host on purpose, so
they never wait for the device; a plain PyTorch loop makes the same reads. On a CPU every read
is cheap, but the count is exactly what would block on an accelerator. `paused()` stops
counting for code that is allowed to read (the log line).
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from typing import Any, Callable, Dict, Iterator

import torch

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_TENSOR_READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__",
                 "__format__")


class HostSyncCounter:
    """Counts host reads of tensor values (and device synchronise calls) while entered."""

    def __init__(self) -> None:
        self.count = 0
        self.sites: Counter = Counter()
        self._paused = 0
        self._saved: Dict[str, Any] = {}
        self._sync_saved: list = []

    def _counted(self, name: str, original: Callable) -> Callable:
        def read(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if not self._paused and not frame.f_code.co_filename.startswith(_TORCH_DIR):
                self.count += 1
                self.sites[f"{name} at {frame.f_code.co_filename}:{frame.f_lineno}"] += 1
            return original(*args, **kwargs)
        return read

    def __enter__(self) -> "HostSyncCounter":
        for name in _TENSOR_READS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        for module in (torch.cuda, getattr(torch, "accelerator", None)):
            if module is not None and hasattr(module, "synchronize"):
                self._sync_saved.append((module, module.synchronize))
                setattr(module, "synchronize", self._counted("synchronize", module.synchronize))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            if original is None:  # inherited from the C base class
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        for module, original in self._sync_saved:
            module.synchronize = original
        self._saved.clear()
        self._sync_saved.clear()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Do not count inside (code allowed to read, such as the log line)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
