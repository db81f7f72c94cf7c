"""Checkpoint integrity: a sha256 per shard, computed while the shard is written and checked
before it is deserialised, and a small report every rank shares after each step of a save
so that all ranks agree whether the save succeeded (a failing rank never leaves the others
waiting in a barrier).

The checksum is of the file's bytes as they go to disk (no second read at save; one
streaming read at load). It lands in the checkpoint's metadata.json, which rank 0 writes
only after every rank reported its shard complete.
"""
from __future__ import annotations

import errno as errno_codes
import hashlib
import io
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

# Exchange one row of int64 values with every rank; returns every rank's row in rank order.
Gather = Callable[[List[int]], List[List[int]]]
CHECKSUM = "sha256"
_READ_CHUNK = 1 << 22
_DIGEST_WORDS = 4  # a sha256 digest travels as 4 signed int64


class HashingWriter(io.RawIOBase):
    """A write-only file object that hashes and counts the bytes on their way to `file`."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__()
        self._file = file
        self._sha = hashlib.sha256()
        self.nbytes = 0
        self.error: Optional[OSError] = None  # torch may replace it by its own RuntimeError

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        try:
            self._file.write(view)  # a buffered file writes everything or raises
        except OSError as err:
            self.error = err
            raise
        self._sha.update(view)
        self.nbytes += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        if not self._file.closed:  # IOBase's finaliser flushes too, after the file closed
            self._file.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def write_hashed(path: str, write: Callable[[HashingWriter], object]) -> Tuple[str, int]:
    """Create `path`, let `write` fill it, flush it to the disk; returns (sha256, bytes)."""
    with open(path, "wb") as f:
        writer = HashingWriter(f)
        try:
            write(writer)
            f.flush()
            os.fsync(f.fileno())
        except Exception as err:
            if writer.error is not None and writer.error is not err:
                raise writer.error from err  # the OS's reason (say, ENOSPC), not torch's
            raise
    return writer.hexdigest(), writer.nbytes


def file_sha256(path: str) -> Tuple[str, int]:
    """(sha256 hex digest, size) of a file, read in chunks."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_READ_CHUNK)
            if not chunk:
                return sha.hexdigest(), size
            sha.update(chunk)
            size += len(chunk)


def state_nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays inside a nested state: the size estimate of a shard."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    return 0


def free_bytes(path: str) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return -1


def single_process_gather(row: List[int]) -> List[List[int]]:
    """The Gather of a job of one process."""
    return [list(row)]


def job_gather(device: torch.device) -> Gather:
    """A Gather over every rank of the job (the world group), on the job's device."""
    from gigatron.parallel import comm

    def gather(row: List[int]) -> List[List[int]]:
        n = comm.group_size()
        mine = torch.tensor(row, dtype=torch.int64, device=device)
        out = torch.empty(n * len(row), dtype=torch.int64, device=device)
        comm.all_gather(out, mine)
        return out.view(n, len(row)).tolist()
    return gather


@dataclass
class StepReport:
    """What one rank tells the others after a step of a save (one row of int64)."""

    coords: Dict[str, int]
    state_bytes: int = 0
    failed: bool = False
    errno: int = 0
    free_bytes: int = 0
    file_bytes: int = 0
    sha256: str = ""
    error: Optional[BaseException] = field(default=None, compare=False)  # this rank's only

    def __post_init__(self) -> None:
        # cp index 0 goes unnamed, as in folders.rank_file: a report compares equal either way
        if "cp" in self.coords and not self.coords["cp"]:
            self.coords = {k: v for k, v in self.coords.items() if k != "cp"}

    def row(self) -> List[int]:
        digest = bytes.fromhex(self.sha256) if self.sha256 else bytes(8 * _DIGEST_WORDS)
        words = [int.from_bytes(digest[8 * i:8 * i + 8], "big", signed=True)
                 for i in range(_DIGEST_WORDS)]
        return [int(self.failed), self.errno, self.state_bytes, self.free_bytes,
                self.coords["tp"], self.coords["pp"], self.coords["dp"], self.file_bytes,
                self.coords.get("cp", 0)] + words

    @staticmethod
    def from_row(row: List[int]) -> "StepReport":
        digest = b"".join(int(w).to_bytes(8, "big", signed=True) for w in row[9:])
        return StepReport({"tp": row[4], "pp": row[5], "dp": row[6], "cp": row[8]}, row[2],
                          bool(row[0]), row[1], row[3], row[7],
                          digest.hex() if any(digest) else "")

    def fail(self, err: BaseException, where: str) -> None:
        """Record a failure of this rank (the free space of `where` tells a full disk)."""
        self.failed, self.error = True, err
        self.errno = _errno_of(err)
        self.free_bytes = free_bytes(where)


def _errno_of(err: BaseException) -> int:
    """The OS error number behind `err` (torch wraps some in RuntimeError), else 0."""
    seen: Optional[BaseException] = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno:
            return int(seen.errno)
        seen = seen.__cause__ or seen.__context__
    return 0


def raise_if_any_failed(gather: Gather, failure: Optional[BaseException],
                        for_others: Callable[[List[int]], str]) -> None:
    """Collective: every rank learns which ranks failed a step; a failed rank raises its own
    error, the others one made by `for_others(failed ranks)`, so that none goes on to wait
    in a collective for a rank that has stopped."""
    failed = [rank for rank, row in enumerate(gather([int(failure is not None)])) if row[0]]
    if failure is not None:
        raise failure
    if failed:
        raise ValueError(for_others(failed))


def exchange(gather: Gather, report: StepReport) -> List[StepReport]:
    """Every rank's report of this step, in rank order (a collective: all ranks call it)."""
    return [StepReport.from_row(r) for r in gather(report.row())]


def human_bytes(n: int) -> str:
    """'12 bytes', '3.5 KiB', '1.2 GiB'."""
    if abs(n) < 1024:
        return f"{n} bytes"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.1f} {unit}"


def first_sentence(err: BaseException) -> str:
    """`Type: first sentence of the message`, for an error quoted inside ours."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = text.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def failure_reason(rank: int, report: StepReport, own: Optional[BaseException]) -> str:
    """Why `rank` failed, as this rank knows it (its own exception, else the error number)."""
    if own is not None:
        return first_sentence(own)
    if report.errno:
        return f"[Errno {report.errno}] {os.strerror(report.errno)}"
    return f"see rank {rank}'s own error line"


def what_to_do(report: StepReport, root: str) -> str:
    """The fix for a failed save, from the failing rank's error number and free space."""
    if report.errno in (errno_codes.ENOSPC, errno_codes.EDQUOT) or report.free_bytes == 0:
        return "free space there or point --save at a disk with room"
    if report.errno in (errno_codes.EACCES, errno_codes.EPERM, errno_codes.EROFS):
        return f"make {root} writable or point --save at a folder this job may write"
    return "fix the cause named above"


def amount(n: int) -> str:
    """'512.0 KiB = 524288 bytes', or '12 bytes' when small."""
    return f"{n} bytes" if n < 1024 else f"{human_bytes(n)} = {n} bytes"


def space_sentence(reports: List[StepReport], failed: StepReport, where: str) -> str:
    """The bytes a save needs (estimated) against the bytes that were free."""
    needed = sum(r.state_bytes for r in reports)
    free = amount(failed.free_bytes) if failed.free_bytes >= 0 else "an unknown number of bytes"
    return (f"the checkpoint needs about {amount(needed)} (an estimate: the bytes of the "
            f"tensors being saved, summed over all ranks) and {where} had {free} free when the "
            f"write failed")


def checksum_mismatch(path: str, iteration: Optional[int], metadata_path: str, expected: str,
                      actual: str, expected_bytes: int, actual_bytes: int) -> str:
    """The first sentence of the error for a shard whose bytes changed since it was saved."""
    if expected_bytes != actual_bytes:
        what = (f"has {actual_bytes} bytes but {expected_bytes} were written (truncated or "
                f"overwritten)")
    else:
        what = "does not match the checksum recorded when it was saved (its bytes changed)"
    return (f"checkpoint shard {path} of iteration {iteration} {what}: {metadata_path} "
            f"expects {CHECKSUM} {expected}, the file has {actual}; refusing to load it")
