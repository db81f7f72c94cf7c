"""An error that every rank finds the same way is printed once, not once per rank.

Errors found after launch (an empty --split share, a checkpoint that does not fit the
layout) are usually found by every rank alike: printed by each, the user reads the same
line N times. Rank 0 publishes its line in the job's store (the watchdog's client of the
launcher's rendezvous store) and prints it; another rank prints its own line only when rank
0's differs or does not come within `REPORT_WAIT_S` (an error of that rank alone: rank 0 is
still training, or failed otherwise).
"""
from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from gigatron.parallel.watchdog import Watchdog

REPORT_WAIT_S = 5.0
REPORTED_KEY = "error/rank0"


def should_print(line: str, rank: int, watchdog: Optional["Watchdog"],
                 wait_s: float = REPORT_WAIT_S) -> bool:
    """Whether this rank prints `line`: rank 0 (publishing it) and any rank whose line rank
    0 did not report; True whenever the store cannot tell (one rank, no store)."""
    if watchdog is None:
        return True
    store, key = watchdog.store, watchdog.prefix + REPORTED_KEY
    try:
        if rank == 0:
            store.set(key, line)
            return True
        store.wait([key], timedelta(seconds=wait_s))
        reported = store.get(key)
    except Exception:  # rank 0 said nothing in time, or the store is gone: say it here
        return True
    text = reported.decode() if isinstance(reported, bytes) else str(reported)
    return text != line


def data_worker_failure(err: BaseException) -> Optional[str]:
    """One line for a DataLoader worker process that died (torch raises 'DataLoader worker
    (pid(s) N) exited unexpectedly' from 'is killed by signal: Killed.'); None for any other
    error."""
    chain = [e for e in (err, err.__cause__, err.__context__) if e is not None]
    texts = [str(e).strip().rstrip(".") for e in chain if "DataLoader worker" in str(e)]
    if not texts:
        return None
    detail = next((t for t in texts if "signal" in t), texts[0])
    return (f"a data loader worker process died ({detail}): it was killed or crashed (the "
            f"kernel's out-of-memory killer? see dmesg); --num-workers 0 reads the data in "
            f"the training process")
