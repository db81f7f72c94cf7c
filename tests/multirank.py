"""Run a function on N forked gloo ranks and hand each rank's result back to the test.

    results = run_on_ranks(fn, world_size=8, *args)   # fn(rank, world_size, *args)

Forking starts 8 ranks in well under a second (spawning costs ~20 s). The parent hosts the
rendezvous store on a free port it gets from the OS (no port races between runs). A rank
that raises fails the test with that rank's number and traceback; a rank that hangs fails
it after `timeout` seconds; every worker is killed before we return, so nothing is left.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, List

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120.0


class RankError(RuntimeError):
    """A worker rank raised; the message carries its rank and traceback."""


class RanksTimedOut(RuntimeError):
    """Some ranks did not finish within the bound."""


def _worker(rank: int, world_size: int, port: int, timeout: float, results,
            fn: Callable, args: tuple, kwargs: dict) -> None:
    try:
        torch.set_num_threads(1)  # 8 ranks share 2 cores: threads would only fight
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout))
        value = fn(rank, world_size, *args, **kwargs)
        payload = ("ok", pickle.dumps(value))
    except BaseException as err:  # report everything, including KeyboardInterrupt/SystemExit
        payload = ("error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    results.put((rank,) + payload)
    results.close()
    results.join_thread()  # flush the queue's feeder thread before the hard exit below
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)  # skip the parent's atexit handlers (pytest's) in the forked child


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any,
                 timeout: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> List[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` forked gloo ranks.

    Returns the list of each rank's return value, indexed by rank.
    """
    ctx = mp.get_context("fork")
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=timeout))
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, store.port, timeout, results, fn, args, kwargs))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, world_size, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join(timeout=5)
        results.close()
        del store


def _collect(procs, results, world_size: int, timeout: float) -> List[Any]:
    deadline = time.monotonic() + timeout
    done = {}
    while len(done) < world_size:
        try:
            rank, status, payload = results.get(timeout=0.2)
        except queue_mod.Empty:
            for r, p in enumerate(procs):
                if r not in done and p.exitcode not in (None, 0):
                    raise RankError(f"rank {r} died with exit code {p.exitcode} "
                                    f"(killed by a signal if negative) and reported nothing")
            if time.monotonic() > deadline:
                missing = sorted(set(range(world_size)) - set(done))
                raise RanksTimedOut(f"ranks {missing} of {world_size} did not finish within "
                                    f"{timeout:.0f} s (hung?); finished: {sorted(done)}")
            continue
        if status == "error":
            raise RankError(f"rank {rank} failed:\n{payload}")
        done[rank] = pickle.loads(payload)
    return [done[r] for r in range(world_size)]
