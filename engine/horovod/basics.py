"""Horovod's process queries for `gigatron.horovod`: init, size/rank, local and cross ranks.

`hvd.init()` joins the job through `gigatron.parallel.world` (torchrun, SLURM, Open MPI's
`mpirun`, MPICH/PMIx, `gigatron launch`), adopts a process group that already exists, and is
a world of one with no launcher at all. Horovod's node layout comes from one all-gather of
every rank's host name and local rank: `local_size` counts the ranks on this host,
`cross_rank`/`cross_size` place this rank among the ranks with its local rank (one per node
on a homogeneous cluster), as Horovod defines them.
"""
from __future__ import annotations

import atexit
import enum
import gc
import os
import pickle
import socket
from dataclasses import dataclass
from typing import List, NoReturn, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from gigatron.parallel import comm as collectives
from gigatron.parallel import timeline
from gigatron.parallel.world import current_device, init_distributed, read_launch_env


class HorovodReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with its numbering (hvd.Average == 0, hvd.Sum == 1, ...)."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum = HorovodReduceOp.AVERAGE, HorovodReduceOp.SUM, HorovodReduceOp.ADASUM
Min, Max, Product = HorovodReduceOp.MIN, HorovodReduceOp.MAX, HorovodReduceOp.PRODUCT


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer went away): Horovod's exception, so elastic-style
    `except hvd.HorovodInternalError` handlers catch it."""


def not_implemented(what: str, hint: str) -> NoReturn:
    """The one error for a Horovod feature gigatron.horovod does not have."""
    raise NotImplementedError(f"{what} is not implemented in gigatron.horovod: {hint}")


@dataclass(frozen=True)
class _State:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int
    homogeneous: bool
    owns_group: bool  # init() created the process group, so the exit destroys it
    pid: int


_state: Optional[_State] = None


def node_layout(hosts: Sequence[str], local_ranks: Sequence[int], rank: int
                ) -> Tuple[int, int, int, bool]:
    """(local_size, cross_rank, cross_size, homogeneous) of `rank` from every rank's host
    and local rank; cross ranks are the ranks sharing this rank's local rank, in rank order."""
    local_size = sum(h == hosts[rank] for h in hosts)
    cross = [r for r, lr in enumerate(local_ranks) if lr == local_ranks[rank]]
    per_host = {h: sum(x == h for x in hosts) for h in hosts}
    return local_size, cross.index(rank), len(cross), len(set(per_host.values())) == 1


def init() -> None:
    """Join the job: every rank calls it once before any other call (hvd.init is
    process_sets.init, which also registers process sets)."""
    global _state
    if _state is not None and _state.pid == os.getpid():
        return
    global _owned_group_pid
    launch = read_launch_env()
    owns = _owned_group_pid == os.getpid() and dist.is_initialized()
    if not dist.is_initialized() and launch.world_size > 1:
        launch, _ = init_distributed()
        owns, _owned_group_pid = True, os.getpid()
        # leave at exit, so gloo's threads stop before the interpreter tears down
        atexit.register(_destroy_owned_group)
    the_rank, the_size = comm_rank_size()
    local_rank = launch.local_rank if launch.launcher != "none" else -1
    hosts, local_ranks = _gather_hosts(local_rank)
    local_ranks = [lr if lr >= 0 else hosts[:r].count(hosts[r])
                   for r, lr in enumerate(local_ranks)]
    local_size, cross_rank, cross_size, homogeneous = node_layout(hosts, local_ranks, the_rank)
    _state = _State(the_rank, the_size, local_ranks[the_rank], local_size, cross_rank,
                    cross_size, homogeneous, owns, os.getpid())
    timeline.start_from_env(f"rank {the_rank}")  # GIGATRON_TIMELINE, or gigatron launch's


def comm_rank_size() -> Tuple[int, int]:
    """(rank, world size) of the process group, (0, 1) without one."""
    return collectives.group_rank(), collectives.group_size()


def _gather_hosts(local_rank: int) -> Tuple[List[str], List[int]]:
    """Every rank's (host name, launcher local rank or -1), in rank order."""
    mine = (socket.gethostname(), local_rank)
    if collectives.group_size() == 1:
        return [mine[0]], [mine[1]]
    data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
    gathered = gather_bytes(data)
    pairs = [pickle.loads(b.numpy().tobytes()) for b in gathered]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def gather_bytes(data: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's uint8 tensor (lengths may differ), in rank order, on the CPU."""
    device = comm_device()
    sizes = collectives.all_gather_uneven(torch.tensor([data.numel()], device=device)).wait()
    joined = collectives.all_gather_uneven(data.to(device)).wait().cpu()
    return list(torch.split(joined, sizes.tolist()))


def comm_device() -> torch.device:
    """Where collectives take their tensors: the accelerator under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return current_device()
    return torch.device("cpu")


def shutdown() -> None:
    """Leave the job (Horovod's hvd.shutdown): queries raise until init() again. The process
    group init() created stays up for that next init() (a new rendezvous on the launcher's
    port would race the old one's sockets and keys) and is destroyed at exit."""
    global _state
    _state = None


_owned_group_pid: Optional[int] = None  # the process whose init() made the process group


def _destroy_owned_group() -> None:
    global _state, _owned_group_pid
    if _owned_group_pid == os.getpid() and dist.is_initialized():
        # Finished collectives caught in reference cycles would otherwise be freed by gloo's
        # threads during interpreter teardown, which aborts the process (torch 2.13).
        gc.collect()
        dist.destroy_process_group()
    _state, _owned_group_pid = None, None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording gigatron's timeline (one Chrome trace merged over every rank) into
    `file_path`; every rank calls it. `mark_cycles` is Horovod's and has no meaning here."""
    timeline.start(file_path, f"rank {rank()}")


def stop_timeline() -> None:
    """Stop the timeline and write the merged trace (on rank 0); every rank calls it."""
    _get()
    timeline.finish()


def is_initialized() -> bool:
    """Whether hvd.init() has run in this process."""
    return _state is not None and _state.pid == os.getpid()


def _get() -> _State:
    if _state is None or _state.pid != os.getpid():
        raise ValueError("gigatron.horovod has not been initialized; use hvd.init().")
    return _state


def size() -> int:
    """Number of processes in the job."""
    return _get().size


def rank() -> int:
    """This process's rank in the job."""
    return _get().rank


def local_size() -> int:
    """Number of processes on this process's node."""
    return _get().local_size


def local_rank() -> int:
    """This process's rank on its node (pin the GPU with it)."""
    return _get().local_rank


def cross_size() -> int:
    """Number of processes sharing this process's local rank (nodes, when homogeneous)."""
    return _get().cross_size


def cross_rank() -> int:
    """This process's rank among those sharing its local rank (its node's index)."""
    return _get().cross_rank


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes."""
    return _get().homogeneous


def mpi_built() -> bool:
    """False: collectives go through torch.distributed (gloo/NCCL), not an MPI library."""
    return False


def mpi_enabled() -> bool:
    """False: see mpi_built (mpirun only starts the processes)."""
    return False


def mpi_threads_supported() -> bool:
    """False: no MPI library is used."""
    return False


def gloo_built() -> bool:
    """Whether torch has the gloo backend (CPU collectives)."""
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Whether this job's collectives run on gloo."""
    return not dist.is_initialized() or dist.get_backend() == "gloo"


def nccl_built() -> bool:
    """Whether torch has the NCCL backend (GPU collectives)."""
    return dist.is_nccl_available()


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False
