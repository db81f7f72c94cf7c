"""Run a function on N forked gloo ranks and hand each rank's result back to the test.

    results = run_on_ranks(fn, world_size=8, *args)   # fn(rank, world_size, *args)

Forking starts 8 ranks in well under a second (spawning costs ~20 s). Rank 0 hosts the
rendezvous store on a free port the OS picked for this run. (Hosting the store in the parent
made the forked children hang now and then: its server thread is running when they fork.)
A rank that raises fails the test with that rank's number and traceback, a rank that dies
silently is named with its exit code, and a rank that hangs fails the test after `timeout`
seconds; every worker is killed before we return, so nothing is left behind.
"""
from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import signal
import socket
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
    # Everything the rank inherited from pytest's process (~1 GB of modules and objects)
    # leaves the collector's view: a gc.collect() in the rank (the activation benchmarks,
    # DeepSpeed's exit hook) walked all of it and copied its pages (a cp=4 world 1.1 -> 0.25
    # CPU-s); what the rank creates is collected as before.
    gc.freeze()
    try:
        torch.set_num_threads(1)  # 8 ranks share 2 cores: threads would only fight
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
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
    port = free_port()
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, timeout, results, fn, args, kwargs))
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


def free_port() -> int:
    """A TCP port the OS says is free now (it hands out ports in turn, so runs differ)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]




def _collect(procs, results, world_size: int, timeout: float) -> List[Any]:
    deadline = time.monotonic() + timeout
    done, errors, grace_end = {}, {}, None
    while len(done) + len(errors) < world_size:
        now = time.monotonic()
        if grace_end is not None and now > grace_end:
            break
        try:
            rank, status, payload = results.get(timeout=0.1)
        except queue_mod.Empty:
            if grace_end is None and _silently_dead(procs, done, errors):
                grace_end = now + 1.0  # let peers report, then name the root cause
            if grace_end is None and now > deadline:
                missing = sorted(set(range(world_size)) - set(done))
                raise RanksTimedOut(f"ranks {missing} of {world_size} did not finish within "
                                    f"{timeout:.0f} s (hung?); finished: {sorted(done)}")
            continue
        if status == "error":
            errors[rank] = payload
            # peers of a failed rank fail too (connection reset): give the real cause a moment
            grace_end = grace_end or time.monotonic() + 1.0
        else:
            done[rank] = pickle.loads(payload)
    if errors or grace_end is not None:
        raise RankError(_failure_message(procs, done, errors))
    return [done[r] for r in range(world_size)]


def _silently_dead(procs, done, errors) -> List[int]:
    return [r for r, p in enumerate(procs)
            if r not in done and r not in errors and p.exitcode not in (None, 0)]


def _failure_message(procs, done, errors) -> str:
    """Silent deaths first (the root cause), then the first error reported, then the rest."""
    parts = [f"rank {r} died with exit code {procs[r].exitcode} (killed by a signal if "
             f"negative) and reported nothing" for r in _silently_dead(procs, done, errors)]
    parts += [f"rank {r} failed:\n{tb}" for r, tb in errors.items()]
    others = [p.replace(" failed:\n", ": ").split("\n")[0] for p in parts[1:]]
    return "\n".join(parts[:1] + [f"also {o}" for o in others])
