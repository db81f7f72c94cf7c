"""The engine's process group: joined once, from any launcher, or a world of one without one.

`init_distributed` is DeepSpeed's `deepspeed.init_distributed` for gigatron: torchrun, SLURM
and MPI (Open MPI, MPICH/PMI) variables through `gigatron.parallel.world`; gloo on CPU, NCCL
on GPU. Unlike DeepSpeed, a plain `python train.py` with no launcher is a world of one (no
process group at all: every collective of `comm` is a no-op then).

A checkpoint save or load is collective: `require_every_rank` makes every caller wait (on the
launcher's store, with the collective timeout) until every rank has called, and otherwise
fails on every caller naming the ranks that did not -- DeepSpeed hangs forever there.
"""
from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional

import torch
import torch.distributed as dist

from gigatron.parallel.world import LaunchEnv, device_and_backend, read_launch_env

DEFAULT_TIMEOUT = timedelta(minutes=30)  # DeepSpeed's default_pg_timeout


@dataclass
class DistributedContext:
    """Where this process sits, and the store a checkpoint call agrees through."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    timeout: timedelta
    store: Any = None  # a TCPStore client (None in a world of one)
    pid: int = 0  # the process that joined (a forked child joins again)


_context: Optional[DistributedContext] = None  # joined once per process, like torch's group


def init_distributed(dist_backend: Optional[str] = None,
                     timeout: Optional[timedelta] = None, **_ignored: Any) -> DistributedContext:
    """Join (or adopt) the job's process group; DeepSpeed's signature, its extra keywords
    (auto_mpi_discovery, distributed_port, verbose, ...) accepted and unused. `timeout`
    (default 30 min, DeepSpeed's) bounds collectives and the checkpoint calls' agreement."""
    global _context
    timeout = timeout or DEFAULT_TIMEOUT
    if _context is not None and _context.pid == os.getpid():
        return _context
    launch = read_launch_env()
    device, backend = device_and_backend(launch.local_rank)
    if not dist.is_initialized() and launch.world_size > 1:
        from gigatron.parallel.world import init_distributed as join

        launch, device = join(timeout.total_seconds() / 60)
        atexit.register(_leave)  # we joined it, so we leave it (scripts rarely do)
    elif dist.is_initialized():
        launch = LaunchEnv(dist.get_rank(), dist.get_world_size(), launch.local_rank,
                           launch.master_addr, launch.master_port, launch.launcher)
    if dist_backend is not None and dist.is_initialized() and dist.get_backend() != dist_backend:
        raise ValueError(f"init_distributed(dist_backend={dist_backend!r}): the process group "
                         f"already uses {dist.get_backend()!r}")
    _context = DistributedContext(launch.rank, launch.world_size, launch.local_rank, device,
                                  timeout, _store(launch, timeout), os.getpid())
    _start_watchdog(launch, timeout)
    return _context


def _leave() -> None:
    """At exit: free finished async work first (gloo can abort when its worker thread frees
    it during interpreter shutdown), then destroy the process group."""
    import gc

    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _store(launch: LaunchEnv, timeout: timedelta) -> Any:
    if launch.world_size < 2:
        return None
    return dist.TCPStore(launch.master_addr, launch.master_port, is_master=False,
                         wait_for_workers=False, timeout=timeout)


def _start_watchdog(launch: LaunchEnv, timeout: timedelta) -> None:
    """A hung rank is named (gigatron.parallel.watchdog); a clean exit says so."""
    from gigatron.parallel.watchdog import start_watchdog

    watchdog = start_watchdog(launch.rank, launch.world_size, launch.master_addr,
                              launch.master_port, timeout.total_seconds())
    if watchdog is not None:
        atexit.register(watchdog.stop, "done")


def require_every_rank(ctx: DistributedContext, what: str, call: int) -> None:
    """Wait until every rank has called `what` (its `call`-th time), within the timeout;
    otherwise raise on this rank naming the ranks that did not."""
    if ctx.store is None:
        return
    prefix = f"gigatron/engine/{what}/{call}/"
    ctx.store.set(prefix + str(ctx.rank), "1")
    keys = [prefix + str(r) for r in range(ctx.world_size)]
    deadline = time.monotonic() + ctx.timeout.total_seconds()
    while not ctx.store.check(keys):
        if time.monotonic() > deadline:
            missing = _missing(ctx, keys)
            raise RuntimeError(
                f"{what} is collective: every rank must call it, but rank"
                f"{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not "
                f"within {ctx.timeout.total_seconds():.0f} s (rank {ctx.rank} called it): call "
                f"{what} on every rank, not only on rank 0")
        time.sleep(0.05)


def _missing(ctx: DistributedContext, keys: List[str]) -> List[int]:
    return [r for r, key in enumerate(keys) if not ctx.store.check([key])]
