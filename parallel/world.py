"""Where this process sits in the job, and the one place that picks device and backend.

Rank, world size, local rank and master address come from the launcher's environment:
torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), SLURM's srun (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, first host of SLURM_NODELIST), Open MPI's mpirun
(OMPI_COMM_WORLD_*) or PMI-based MPIs (PMI_RANK, PMI_SIZE). We add no rendezvous of our own.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

if TYPE_CHECKING:  # torch is imported lazily at run time
    import torch

DEFAULT_MASTER_PORT = 29500
DEFAULT_TIMEOUT_MINUTES = 10.0
RESTART_COUNT_ENV = "GIGATRON_RESTART_COUNT"  # set by `gigatron launch --max_restarts`


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in the job as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # 'torchrun', 'slurm', 'mpi' or 'none'


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist: 'gpu[003-005,9],cpu1' -> 'gpu003'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read SLURM_NODELIST={nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def read_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Read rank/world/master from torchrun, SLURM or MPI variables (in that order)."""
    env = os.environ if env is None else env
    port = int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT))
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(_int(env, "RANK"), _int(env, "WORLD_SIZE"),
                         int(env.get("LOCAL_RANK", 0)), env.get("MASTER_ADDR", "127.0.0.1"),
                         port, "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        master = env.get("MASTER_ADDR") or first_slurm_host(
            env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1"))
        return LaunchEnv(_int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                         int(env.get("SLURM_LOCALID", 0)), master, port, "slurm")
    for rank_var, size_var, local_var, local_size_var in (
            ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE"),
            ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
            ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE")):
        if rank_var in env and size_var in env:
            world = _int(env, size_var)
            return LaunchEnv(_int(env, rank_var), world, int(env.get(local_var, 0)),
                             _mpi_master(env, world, size_var, local_size_var), port, "mpi")
    return LaunchEnv(0, 1, 0, "127.0.0.1", port, "none")


def _mpi_master(env: Mapping[str, str], world: int, size_var: str, local_size_var: str) -> str:
    """MPI sets no master address: MASTER_ADDR, else this host when every rank runs on it
    (`mpirun -np N` on one machine needs no exported variable)."""
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"]
    if world == 1 or env.get(local_size_var) == str(world):
        return "127.0.0.1"
    raise ValueError(
        f"launched by MPI ({size_var}={world}) across several hosts without MASTER_ADDR: "
        f"export MASTER_ADDR=<first node's address> (and MASTER_PORT) to mpirun with -x")


def require_world_size(launch: LaunchEnv, needed: int) -> None:
    """Fail clearly when a job needs more ranks than the launcher started."""
    if launch.launcher == "none" and needed > 1:
        raise ValueError(
            f"this job needs {needed} ranks but no launcher variables were found (RANK/"
            f"WORLD_SIZE, SLURM_PROCID/SLURM_NTASKS or OMPI_COMM_WORLD_*): start it with "
            f"`torchrun --nproc-per-node {needed} ...`, `srun` or `mpirun`")
    if launch.world_size != needed:
        raise ValueError(f"this job needs {needed} ranks but was launched with "
                         f"{launch.world_size}: change the launch or the parallel sizes")


def device_and_backend(local_rank: int = 0) -> Tuple["torch.device", str]:
    """(torch.device, backend): cuda + nccl when a GPU is present, else cpu + gloo."""
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count()), "nccl"
    return torch.device("cpu"), "gloo"


def current_device() -> "torch.device":
    """The device this process computes on: the accelerator `init_distributed` selected
    (torch's current device index), else the CPU."""
    import torch

    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() \
        else None
    if accelerator is not None:
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


def init_distributed(timeout_minutes: float = DEFAULT_TIMEOUT_MINUTES,
                     env: Optional[Mapping[str, str]] = None) -> Tuple[LaunchEnv, "torch.device"]:
    """Join the job's default process group; returns (launch env, device).

    The collective timeout is finite (Megatron's --distributed-timeout-minutes) so a dead
    peer surfaces as an error instead of a hang.
    """
    import torch
    import torch.distributed as dist

    if timeout_minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes must be > 0, got {timeout_minutes}")
    launch = read_launch_env(env)
    device, backend = device_and_backend(launch.local_rank)
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)
    if not dist.is_initialized():
        timeout = timedelta(minutes=timeout_minutes)
        store = attempt_store(launch, os.environ if env is None else env, timeout)
        meet: Dict[str, Any] = {"store": store} if store is not None else {
            "init_method": "env://" if launch.launcher == "torchrun" else
            f"tcp://{launch.master_addr}:{launch.master_port}"}
        # Binding the device makes NCCL build every communicator eagerly (subgroups by
        # ncclCommSplit, inside new_group, with all members present). Lazily, a group's first
        # batched isend/irecv must involve all its ranks (torch leaves it undefined
        # otherwise), and a pipeline batch pairs two stages only.
        bind: Dict[str, Any] = {"device_id": device} if device.type != "cpu" else {}
        # torch._dynamo (which the first optimizer imports) keeps references to the default
        # group when it is imported after the group exists, so destroy_process_group() could
        # not free it and its gloo threads lived on into interpreter teardown, where one
        # freeing a finished collective's tensors aborts the process ("terminate called
        # without an active exception"). Imported first, it holds none.
        import torch._dynamo  # noqa: F401
        dist.init_process_group(backend, rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, **meet, **bind)
    return launch, device


def restart_count(env: Optional[Mapping[str, str]] = None) -> int:
    """How many times this job was restarted before this attempt (0: the first run): torch's
    elastic agent's TORCHELASTIC_RESTART_COUNT plus `gigatron launch`'s own restarts."""
    env = os.environ if env is None else env
    return sum(int(env.get(name) or 0) for name in ("TORCHELASTIC_RESTART_COUNT",
                                                   RESTART_COUNT_ENV))


def attempt_store(launch: LaunchEnv, env: Mapping[str, str], timeout: timedelta
                  ) -> Optional["torch.distributed.Store"]:
    """The store this attempt's process groups meet in: None (torch's env:// or tcp://
    rendezvous) unless torchrun's agent hosts it, which keeps it across `--max-restarts`.

    The agent's store still holds the previous attempt's addresses (gloo: each rank's
    listening port; NCCL: the unique id) under the same keys, so a restarted rank could read
    a dead peer's entry before the new one is written ("Gloo connectFullMesh failed ...
    Connection refused"); a prefix per attempt keeps every attempt's keys apart.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    client = dist.TCPStore(launch.master_addr, launch.master_port, is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"gigatron/attempt_{restart_count(env)}/", client)
