"""The exact command lines that start a planned job: torchrun per node (run here, or over
pdsh/ssh), or one mpirun (Open MPI, MPICH) / srun that starts every rank.

"torchrun" is `python -m gigatron.parallel.launcher.node` with torchrun's flags: it runs
`torch.distributed.run` and turns the agent's failure traceback into a few lines.

Pure: the Python executable, the working directory and the variables to forward come in as
arguments, so `--dry_run` prints what a real launch runs and tests compare whole lines.
Every rank runs `python -u -m gigatron.parallel.launcher.worker [opts] script args`: the
worker maps torchrun/MPI/SLURM variables to RANK/LOCAL_RANK/WORLD_SIZE/MASTER_*, appends
`--local_rank=K` and records a failure for the launcher's report.
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from .plan import LaunchPlan, LaunchRequest, NodePlan

WORKER_MODULE = "gigatron.parallel.launcher.worker"
NODE_MODULE = "gigatron.parallel.launcher.node"  # torchrun's flags, a short failure report
TIMELINE_ENV = "GIGATRON_TIMELINE"  # the timeline contract: each rank writes its part there
PDSH_MAX_FAN_OUT = 1024
# variables forwarded to other nodes: DeepSpeed's prefixes plus ours
EXPORT_PREFIXES = ("NCCL_", "PYTHON", "UCX_", "MLFLOW", "MV2_", "GIGATRON_", "OMP_NUM_THREADS")


@dataclass(frozen=True)
class Command:
    """One process the launcher starts: a header for --dry_run, argv and extra env."""

    what: str
    argv: Tuple[str, ...]
    env: Tuple[Tuple[str, str], ...] = ()

    def shell(self) -> str:
        """The line a user can paste into a shell."""
        prefix = "".join(f"{key}={shlex.quote(value)} " for key, value in self.env)
        return prefix + shlex.join(self.argv)


def forwarded_env(env: Mapping[str, str], extra: Optional[Mapping[str, str]] = None
                  ) -> Dict[str, str]:
    """Variables other nodes must see: NCCL_*, PYTHON*, UCX_*, GIGATRON_*, ... plus `extra`
    (the .deepspeed_env file's lines), as DeepSpeed exports them."""
    found = {k: v for k, v in sorted(env.items()) if k.startswith(EXPORT_PREFIXES)}
    found.update(extra or {})
    return found


def worker_argv(req: LaunchRequest) -> List[str]:
    """`-m gigatron.parallel.launcher.worker [--no_local_rank] [--log_dir D] script args`."""
    argv = ["-m", WORKER_MODULE]
    if req.no_local_rank:
        argv.append("--no_local_rank")
    if req.log_dir:
        argv += ["--log_dir", req.log_dir]
    return argv + [req.script, *req.script_args]


def node_env(req: LaunchRequest, node: NodePlan) -> Dict[str, str]:
    """What this node's workers get on top of the environment: devices, timeline."""
    env = {}
    if node.visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = node.visible_devices
    if req.timeline:
        env[TIMELINE_ENV] = req.timeline
    return env


def torchrun_argv(plan: LaunchPlan, node: NodePlan, req: LaunchRequest, python: str,
                  node_rank: str = "") -> List[str]:
    """`python -u -m <node> --nnodes ... -m <worker> script args`: torchrun for one node."""
    restarts = [f"--max-restarts={req.max_restarts}"] if req.max_restarts else []
    return [python, "-u", "-m", NODE_MODULE, f"--nnodes={len(plan.nodes)}",
            f"--node-rank={node_rank or node.node_rank}", f"--nproc-per-node={node.nproc}",
            f"--master-addr={plan.master_addr}", f"--master-port={plan.master_port}",
            *restarts, *worker_argv(req)]


def _remote(cwd: str, env: Mapping[str, str], argv: List[str]) -> str:
    assignments = "".join(f"{key}={shlex.quote(value)} " for key, value in env.items())
    return f"cd {shlex.quote(cwd)} && {assignments}{shlex.join(argv)}"


def torchrun_commands(plan: LaunchPlan, req: LaunchRequest, python: str) -> List[Command]:
    """One torchrun per node, run by hand (or by --node_rank K) on that node."""
    nodes = plan.nodes if plan.local_node is None else (plan.nodes[plan.local_node],)
    return [Command(f"node {node.node_rank} ({node.host}): {_ranks(node)}",
                    tuple(torchrun_argv(plan, node, req, python)),
                    tuple(node_env(req, node).items())) for node in nodes]


def _ranks(node: NodePlan) -> str:
    first, last = node.ranks.start, node.ranks.stop - 1
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def pdsh_commands(plan: LaunchPlan, req: LaunchRequest, python: str, cwd: str,
                  exports: Mapping[str, str]) -> List[Command]:
    """pdsh to every node at once (`--node-rank=%n`) when the nodes are alike, else per node."""
    fan = ["pdsh", "-S", "-f", str(PDSH_MAX_FAN_OUT)]
    extra = shlex.split(req.launcher_args)
    env = (("PDSH_RCMD_TYPE", "ssh"),)
    first = plan.nodes[0]
    if all((n.nproc, n.devices) == (first.nproc, first.devices) for n in plan.nodes):
        remote = _remote(cwd, {**exports, **node_env(req, first)},
                         torchrun_argv(plan, first, req, python, node_rank="%n"))
        hosts = ",".join(node.host for node in plan.nodes)
        return [Command(f"nodes 0-{len(plan.nodes) - 1} ({hosts}) over pdsh",
                        tuple(fan + ["-w", hosts] + extra + [remote]), env)]
    return [Command(f"node {n.node_rank} ({n.host}) over pdsh",
                    tuple(fan + ["-w", n.host] + extra + [_remote(
                        cwd, {**exports, **node_env(req, n)},
                        torchrun_argv(plan, n, req, python))]), env) for n in plan.nodes]


def ssh_commands(plan: LaunchPlan, req: LaunchRequest, python: str, cwd: str,
                 exports: Mapping[str, str]) -> List[Command]:
    """`ssh [launcher args] HOST 'cd CWD && VARS torchrun ...'` per node."""
    extra = shlex.split(req.launcher_args)
    return [Command(f"node {n.node_rank} ({n.host}) over ssh",
                    tuple(["ssh"] + extra + [n.host, _remote(
                        cwd, {**exports, **node_env(req, n)},
                        torchrun_argv(plan, n, req, python))])) for n in plan.nodes]


def _rank_env(plan: LaunchPlan, req: LaunchRequest, exports: Mapping[str, str]
              ) -> Dict[str, str]:
    env = {"MASTER_ADDR": plan.master_addr} if plan.master_addr else {}
    env["MASTER_PORT"] = str(plan.master_port)
    env.update(exports)
    if req.timeline:
        env[TIMELINE_ENV] = req.timeline
    return env


def openmpi_command(plan: LaunchPlan, req: LaunchRequest, python: str,
                    exports: Mapping[str, str], by_name: Sequence[str] = ("PATH",)
                    ) -> Command:
    """Open MPI's mpirun starting every rank; `-H host:slots` carries the plan's hosts and
    `-x NAME` forwards `by_name` (PATH, LD_LIBRARY_PATH where set) as DeepSpeed does."""
    hosts = ",".join(f"{node.host}:{node.nproc}" for node in plan.nodes)
    argv = ["mpirun", "--allow-run-as-root", "-np", str(plan.world_size), "-H", hosts,
            "--bind-to", "none"]
    for key, value in _rank_env(plan, req, exports).items():
        argv += ["-x", f"{key}={value}"]
    for name in by_name:
        argv += ["-x", name]
    argv += shlex.split(req.launcher_args)
    return Command(f"{plan.world_size} ranks on {hosts} with Open MPI",
                   tuple(argv + [python, "-u"] + worker_argv(req)))


def mpich_command(plan: LaunchPlan, req: LaunchRequest, python: str,
                  exports: Mapping[str, str]) -> Command:
    """MPICH's (Hydra) mpirun: -n total, -ppn per node, -genv for the variables."""
    per_node = plan.nodes[0].nproc
    argv = ["mpirun", "-n", str(plan.world_size), "-ppn", str(per_node)]
    argv += shlex.split(req.launcher_args)
    env = _rank_env(plan, req, exports)
    env.update(WORLD_SIZE=str(plan.world_size), LOCAL_SIZE=str(per_node))
    for key, value in env.items():
        argv += ["-genv", key, value]
    hosts = ",".join(node.host for node in plan.nodes)
    argv += ["-hosts", hosts, python, "-u"] + worker_argv(req)
    return Command(f"{plan.world_size} ranks on {hosts} with MPICH", tuple(argv))


def slurm_command(plan: LaunchPlan, req: LaunchRequest, python: str,
                  exports: Mapping[str, str]) -> Command:
    """srun starting every rank (-n from the hostfile or -np; else the allocation decides)."""
    argv = ["srun"]
    total = plan.world_size if plan.nodes else req.np
    if total > 0:
        argv += ["-n", str(total)]
    argv += shlex.split(req.launcher_args)
    if req.include:
        argv += ["--nodelist", req.include.replace("@", ",")]
    if req.exclude:
        argv += ["--exclude", req.exclude.replace("@", ",")]
    if req.num_nodes > 0:
        argv += ["--nodes", str(req.num_nodes)]
    if req.num_gpus > 0:
        argv += ["--ntasks-per-node", str(req.num_gpus)]
    env = _rank_env(plan, req, exports)
    argv.append("--export=" + ",".join(["ALL"] + [f"{k}={v}" for k, v in env.items()]))
    return Command(f"{total if total > 0 else 'all allocated'} ranks with SLURM",
                   tuple(argv + [python, "-u"] + worker_argv(req)))


def launch_commands(plan: LaunchPlan, req: LaunchRequest, python: str, cwd: str,
                    exports: Mapping[str, str], by_name: Sequence[str] = ("PATH",)
                    ) -> List[Command]:
    """The commands that start the planned job, by launcher."""
    if plan.launcher == "torchrun":
        return torchrun_commands(plan, req, python)
    if plan.launcher == "pdsh":
        return pdsh_commands(plan, req, python, cwd, exports)
    if plan.launcher == "ssh":
        return ssh_commands(plan, req, python, cwd, exports)
    if plan.launcher == "openmpi":
        return [openmpi_command(plan, req, python, exports, by_name)]
    if plan.launcher == "mpich":
        return [mpich_command(plan, req, python, exports)]
    return [slurm_command(plan, req, python, exports)]
