"""What the communication stack is here: torch.distributed backends, NCCL, the launch env.

Each probe returns plain data for `gigatron report` and never raises for something missing.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional

from gigatron.parallel.world import read_launch_env

# always listed (null when unset); variables with these prefixes are listed when set
NAMED_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
              "LOCAL_WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "CUDA_HOME",
              "TORCH_CUDA_ARCH_LIST", "TORCH_EXTENSIONS_DIR")
PREFIXES = ("NCCL_", "TORCH_NCCL_", "GIGATRON_")


def comm_backends() -> Dict[str, Any]:
    """Which torch.distributed backends this torch has, and the NCCL version it was built with."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return {"distributed": False, "gloo": False, "nccl": False, "mpi": False,
                "nccl_version": None, "note": "torch was built without torch.distributed"}
    info: Dict[str, Any] = {"distributed": True, "gloo": dist.is_gloo_available(),
                            "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available(),
                            "nccl_version": None, "note": ""}
    if info["nccl"]:
        try:
            version = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(map(str, version)) if isinstance(version, tuple) \
                else str(version)
        except Exception as exc:  # NCCL present but its library cannot load
            info["note"] = f"NCCL version unreadable ({type(exc).__name__}: {exc})"
    return info


def env_vars(env: Optional[Mapping[str, str]] = None) -> Dict[str, Optional[str]]:
    """The launch- and kernel-relevant variables: the named ones (None when unset) and any
    set variable with an NCCL_/TORCH_NCCL_/GIGATRON_ prefix, sorted."""
    env = os.environ if env is None else env
    found: Dict[str, Optional[str]] = {name: env.get(name) for name in NAMED_VARS}
    for name in sorted(env):
        if name.startswith(PREFIXES):
            found[name] = env[name]
    return found


def launcher(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """Which launcher started this process and where it sits, as `init_distributed` will read it."""
    try:
        launch = read_launch_env(env)
    except ValueError as exc:  # e.g. MPI without MASTER_ADDR: say so instead of failing
        return {"launcher": None, "rank": None, "world_size": None, "local_rank": None,
                "master": None, "note": str(exc)}
    return {"launcher": launch.launcher, "rank": launch.rank, "world_size": launch.world_size,
            "local_rank": launch.local_rank, "master": f"{launch.master_addr}:{launch.master_port}",
            "note": ""}


def comm_report(env: Optional[Mapping[str, str]] = None) -> Dict[str, Any]:
    """The communication section of `gigatron report`."""
    return {"backends": comm_backends(), "launcher": launcher(env), "env": env_vars(env)}
