"""A small all-reduce benchmark across the launched ranks: is the network there, and how fast.

Bandwidths follow nccl-tests' definitions: algorithm bandwidth algbw = S / t for a buffer of
S bytes reduced in t seconds, bus bandwidth busbw = algbw * 2(n-1)/n, which is what each
link carries in a ring all-reduce and so is comparable with the hardware's peak.
The time of a size is the median of several timed runs after warm-up, on each rank
(device events on an accelerator, perf_counter on the CPU); the slowest rank's median counts.
Started by `gigatron report --comm-check`, either inside a launched job (torchrun, SLURM,
mpirun, `gigatron launch`) or on N local workers started through torch's elastic launcher.
"""
from __future__ import annotations

import logging
import os
import re
import statistics
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from gigatron.parallel import comm
from gigatron.parallel.world import init_distributed

DEFAULT_SIZES = "1M,16M,64M"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
DTYPE = torch.float32


def parse_sizes(text: str) -> List[int]:
    """'64K,1M,1.5M,4096' -> buffer sizes in bytes (K/M/G are powers of 1024)."""
    sizes = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*", item, re.I)
        if not match:
            raise ValueError(f"cannot read the message size {item.strip()!r}: use e.g. 64K,1M,16M")
        size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
        if size < DTYPE.itemsize:
            raise ValueError(f"message size {item.strip()!r} is under one {DTYPE} element")
        sizes.append(size)
    return sizes


def format_size(nbytes: int) -> str:
    """4194304 -> '4 MiB' (whole units where exact)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.0f} {unit}" if value == int(value) else f"{value:.2f} {unit}"
    return f"{nbytes} B"


def bus_bandwidth(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth: algbw * 2(n-1)/n (0 for a single rank)."""
    return algbw * 2 * (world_size - 1) / world_size


def _timed_allreduce(tensor: torch.Tensor) -> float:
    """Seconds one all-reduce of `tensor` takes on this rank, after a barrier lines ranks up."""
    comm.barrier()
    if tensor.device.type == "cpu":
        start = time.perf_counter()
        comm.all_reduce(tensor)
        return time.perf_counter() - start
    begin, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    begin.record()
    comm.all_reduce(tensor)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def allreduce_medians(sizes: Sequence[int], device: torch.device, warmup: int,
                      iters: int) -> List[float]:
    """Per size, the median seconds of `iters` all-reduces after `warmup`, slowest rank's."""
    medians = []
    for size in sizes:
        tensor = torch.ones(size // DTYPE.itemsize, dtype=DTYPE, device=device)
        for _ in range(warmup):
            comm.all_reduce(tensor)
        medians.append(statistics.median(_timed_allreduce(tensor) for _ in range(iters)))
    slowest = torch.tensor(medians, dtype=torch.float64, device=device)
    comm.all_reduce(slowest, op=comm.ReduceOp.MAX)
    return slowest.tolist()


def results(sizes: Sequence[int], seconds: Sequence[float], world_size: int) -> List[Dict[str, Any]]:
    """One record per size: bytes, time (us), algbw and busbw (GB/s = 1e9 B/s)."""
    rows = []
    for size, t in zip(sizes, seconds):
        algbw = size / t / 1e9 if t > 0 else float("inf")
        rows.append({"bytes": size, "time_us": round(t * 1e6, 1), "algbw_gbps": round(algbw, 3),
                     "busbw_gbps": round(bus_bandwidth(algbw, world_size), 3)})
    return rows


def _check_counts(warmup: int, iters: int) -> None:
    if warmup < 0 or iters < 1:
        raise ValueError(f"need --comm-warmup >= 0 and --comm-iters >= 1, got {warmup} and {iters}")


def run_comm_check(sizes: Sequence[int], warmup: int = 3,
                   iters: int = 10) -> Optional[Dict[str, Any]]:
    """Join the launched job and benchmark; the summary on rank 0, None on the other ranks."""
    _check_counts(warmup, iters)
    owns_group = not dist.is_initialized()
    launch, device = init_distributed()
    try:
        seconds = allreduce_medians(sizes, device, warmup, iters)
        backend = dist.get_backend()
    finally:
        if owns_group:
            dist.destroy_process_group()
    if launch.rank != 0:
        return None
    return {"world_size": launch.world_size, "launcher": launch.launcher, "backend": backend,
            "device": device.type, "dtype": str(DTYPE).replace("torch.", ""), "warmup": warmup,
            "iters": iters, "results": results(sizes, seconds, launch.world_size)}


def local_gpus() -> int:
    """How many GPUs local workers could use (0 with a CPU-only torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_nproc() -> int:
    """Local workers for `--comm-check` without --nproc: one per GPU, or 2 on the CPU."""
    return local_gpus() if local_gpus() >= 2 else 2


def launch_local(nproc: int, sizes: Sequence[int], warmup: int = 3,
                 iters: int = 10) -> Dict[str, Any]:
    """Start `nproc` local workers through torch's elastic launcher (torchrun --standalone's
    rendezvous) and return rank 0's summary; a failed worker raises RuntimeError.

    One GPU per worker when there are enough GPUs; else the workers run on the CPU (gloo),
    since NCCL refuses two ranks on one GPU."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if nproc < 2:
        raise ValueError(f"--nproc must be at least 2 for an all-reduce to mean anything, got {nproc}")
    _check_counts(warmup, iters)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)
    agent_log = logging.getLogger("torch.distributed.elastic")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)  # a failure is reported once, by us, in one line
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if 0 < local_gpus() < nproc:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the spawned workers inherit it: CPU + gloo
    try:
        returned = elastic_launch(config, run_comm_check)(list(sizes), warmup, iters)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message.get("message") if isinstance(failure.message, dict) \
            else failure.message
        raise RuntimeError(f"comm check: local rank {rank} failed "
                           f"(exit code {failure.exitcode}): {message}") from None
    finally:
        agent_log.setLevel(level)
        if visible is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return {**returned[0], "launcher": f"{nproc} local workers (torch elastic)"}


def format_comm_check(summary: Dict[str, Any]) -> str:
    """The benchmark as an aligned table, one line per size."""
    lines = [f"all-reduce of {summary['dtype']} over {summary['world_size']} ranks "
             f"({summary['backend']} on {summary['device']}, launched by {summary['launcher']}; "
             f"median of {summary['iters']} runs after {summary['warmup']} warm-up, slowest rank)",
             f"  {'size':>10}  {'time (us)':>12}  {'algbw (GB/s)':>13}  {'busbw (GB/s)':>13}"]
    for row in summary["results"]:
        lines.append(f"  {format_size(row['bytes']):>10}  {row['time_us']:>12.1f}  "
                     f"{row['algbw_gbps']:>13.3f}  {row['busbw_gbps']:>13.3f}")
    return "\n".join(lines)
