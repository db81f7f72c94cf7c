"""The per-node plan of a launch: which hosts, how many ranks each, which devices, who is master.

A pure function of the request (the flags, the hostfile's text) and of what this machine
has (`Machine`). DeepSpeed's rules and defaults, with Horovod's `-np`/`-H` beside them;
where we differ from DeepSpeed the docstring says so (docs/LAUNCH.md lists it).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from .hosts import LaunchError, Resources, filter_resources, parse_horovod_hosts, parse_hostfile

LAUNCHERS = ("torchrun", "pdsh", "ssh", "openmpi", "mpich", "slurm")
MPI_LAUNCHERS = ("openmpi", "mpich")
DEFAULT_MASTER_PORT = 29500  # DeepSpeed's and torch's TORCH_DISTRIBUTED_DEFAULT_PORT


@dataclass(frozen=True)
class LaunchRequest:
    """What the user asked for, flag by flag (-1 / "" / None: not given, as in DeepSpeed)."""

    script: str
    script_args: Tuple[str, ...] = ()
    num_gpus: int = -1
    num_nodes: int = -1
    np: int = -1  # Horovod's total process count
    hostfile: Optional[str] = None  # path, for messages and commands
    hostfile_text: Optional[str] = None
    hosts: str = ""  # Horovod's -H list
    include: str = ""
    exclude: str = ""
    master_addr: str = ""
    master_port: Optional[int] = None  # None: DEFAULT_MASTER_PORT
    launcher: str = ""
    launcher_args: str = ""
    node_rank: int = -1
    no_local_rank: bool = False
    log_dir: Optional[str] = None
    timeline: Optional[str] = None
    max_restarts: int = 0  # whole-job restarts after a rank fails (torchrun's --max-restarts)


@dataclass(frozen=True)
class Machine:
    """What the launching machine offers, read once so that planning stays pure."""

    gpus: int = 0
    visible_devices: str = ""  # CUDA_VISIBLE_DEVICES as found ("" when unset)


@dataclass(frozen=True)
class NodePlan:
    """One node's part: its ranks and the devices they see."""

    node_rank: int
    host: str
    nproc: int
    first_rank: int
    devices: Optional[Tuple[int, ...]] = None  # CUDA_VISIBLE_DEVICES; None: leave it as is

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)

    @property
    def visible_devices(self) -> Optional[str]:
        return None if self.devices is None else ",".join(map(str, self.devices))


@dataclass(frozen=True)
class LaunchPlan:
    """Every node of the job, the launcher that starts them and the rendezvous address."""

    nodes: Tuple[NodePlan, ...]
    launcher: str
    master_addr: str  # "" under SLURM: the workers take the first host of SLURM_NODELIST
    master_port: int
    local_node: Optional[int]  # the node this process runs through torch's elastic agent
    notes: Tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        return sum(node.nproc for node in self.nodes)

    def world_info(self) -> Dict[str, List[int]]:
        """{host: device ids}: DeepSpeed's world info, what each node runs on."""
        return {node.host: list(node.devices if node.devices is not None else
                                range(node.nproc)) for node in self.nodes}


def _check_counts(req: LaunchRequest) -> None:
    for flag, value in (("--num_gpus", req.num_gpus), ("--num_nodes", req.num_nodes),
                        ("-np", req.np)):
        if value == 0 or value < -1:
            raise LaunchError(f"{flag} {value}: give a count of at least 1 (or leave it out)")
    if req.master_port is not None and not 0 < req.master_port < 65536:
        raise LaunchError(f"--master_port {req.master_port}: give a port in 1..65535")
    if req.node_rank < -1:
        raise LaunchError(f"--node_rank {req.node_rank}: give this node's index, 0 or more")
    if req.max_restarts < 0:
        raise LaunchError(f"--max_restarts {req.max_restarts}: give how many times to restart "
                          f"the job after a failure, 0 or more")


def check_request(req: LaunchRequest) -> None:
    """The flag combinations DeepSpeed (and Horovod) refuse, each as one line."""
    _check_counts(req)
    if req.launcher and req.launcher not in LAUNCHERS:
        raise LaunchError(f"--launcher {req.launcher!r}: choose one of {', '.join(LAUNCHERS)}")
    if req.hostfile_text is not None and req.hosts:
        raise LaunchError("--hostfile and -H both list hosts: give one of them")
    if (req.num_nodes > 0 or req.num_gpus > 0) and (req.include or req.exclude):
        raise LaunchError("--num_nodes/--num_gpus cannot be combined with --include/--exclude"
                          " (DeepSpeed's rule): select hosts and devices with one of them")
    if req.np > 0 and req.num_gpus > 0:
        raise LaunchError("-np (all processes) and --num_gpus (per node) both set the rank "
                          "count: give one of them")
    if req.launcher in MPI_LAUNCHERS:
        if req.include or req.exclude:
            raise LaunchError(f"--launcher {req.launcher} does not support --include/--exclude "
                              f"(mpirun cannot pin devices per node): edit the hostfile instead")
        if req.num_nodes > 0 or req.num_gpus > 0:
            raise LaunchError(f"--launcher {req.launcher} does not support --num_nodes/"
                              f"--num_gpus: give -np N or a hostfile")
    if req.node_rank >= 0 and req.launcher not in ("", "torchrun"):
        raise LaunchError(f"--node_rank runs this node's part here through torchrun; "
                          f"--launcher {req.launcher} starts every node: drop one of them")
    if req.launcher == "slurm":
        for flag, spec in (("--include", req.include), ("--exclude", req.exclude)):
            if ":" in spec:
                raise LaunchError(f"--launcher slurm allocates whole nodes: {flag} {spec!r} "
                                  f"names device slots; name hosts only (h1@h2)")


def _listed_hosts(req: LaunchRequest) -> Optional[Dict[str, int]]:
    if req.hostfile_text is not None:
        return parse_hostfile(req.hostfile_text, f"hostfile {req.hostfile}")
    if req.hosts:
        return parse_horovod_hosts(req.hosts)
    return None


def selects_devices(req: LaunchRequest) -> bool:
    """Whether the flags choose devices, so that CUDA_VISIBLE_DEVICES found is set aside
    (DeepSpeed's rule: it is kept only without --include/--exclude/--num_gpus/--num_nodes)."""
    return bool(req.include or req.exclude or req.num_gpus > 0 or req.num_nodes > 1
                or req.np > 0)


def _local_pool(req: LaunchRequest, machine: Machine) -> Tuple[Resources, bool, List[str]]:
    """This machine's slots: ({'localhost': ids}, whether to pin CUDA_VISIBLE_DEVICES, notes)."""
    notes = []
    if machine.visible_devices and not selects_devices(req):  # DeepSpeed keeps the user's choice
        return {"localhost": list(range(len(machine.visible_devices.split(","))))}, False, []
    if machine.visible_devices and machine.gpus:
        notes.append(f"CUDA_VISIBLE_DEVICES={machine.visible_devices} is ignored because of "
                     f"--include/--exclude/--num_gpus/--num_nodes/-np (as DeepSpeed does)")
    if machine.gpus > 0:
        return {"localhost": list(range(machine.gpus))}, True, notes
    if req.include or req.exclude:
        raise LaunchError("--include/--exclude select GPUs and this machine has none: give "
                          "--num_gpus N (or -np N) for N CPU workers, or a --hostfile")
    count = req.num_gpus if req.num_gpus > 0 else req.np
    if count < 1:
        raise LaunchError("no GPU found on this machine: give --num_gpus N (or -np N) to start "
                          "N CPU workers on gloo, or a --hostfile")
    return {"localhost": list(range(count))}, False, notes


def _take_processes(resources: Resources, np: int, source: str) -> Resources:
    """Horovod's -np: fill the hosts' slots in order until np processes."""
    total = sum(len(slots) for slots in resources.values())
    if np > total:
        raise LaunchError(f"-np {np} but {source} offers {total} slots: lower -np or add hosts")
    taken: Resources = {}
    for host, slots in resources.items():
        if np <= 0:
            break
        taken[host], np = slots[:np], np - len(slots[:np])
    return taken


def _limit(resources: Resources, req: LaunchRequest, source: str, pool_from_gpus: bool
           ) -> Resources:
    """--num_nodes (first N hosts), --num_gpus (devices 0..N-1 on each), -np (first N slots)."""
    if req.num_nodes > 0:
        if req.num_nodes > len(resources):
            raise LaunchError(f"--num_nodes {req.num_nodes} but {source} lists "
                              f"{len(resources)} host(s): lower --num_nodes or add hosts")
        resources = dict(list(resources.items())[:req.num_nodes])
    if req.num_gpus > 0:
        if pool_from_gpus:
            for host, slots in resources.items():
                if req.num_gpus > len(slots):
                    raise LaunchError(f"--num_gpus {req.num_gpus} but {source} gives {host!r} "
                                      f"{len(slots)} slot(s): lower --num_gpus")
        resources = {host: list(range(req.num_gpus)) for host in resources}
    if req.np > 0:
        resources = _take_processes(resources, req.np, source)
    return resources


def _replicated_nodes(local: Resources, req: LaunchRequest) -> Resources:
    """`--num_nodes N` without a hostfile: N nodes shaped like this one (run with --node_rank)."""
    if req.np > 0:
        raise LaunchError("-np counts every process of the job; with --num_nodes and no "
                          "hostfile give --num_gpus (ranks per node) instead")
    if req.node_rank < 0 and req.launcher not in ("torchrun", "slurm"):
        raise LaunchError(f"--num_nodes {req.num_nodes} but no hostfile lists the other nodes: "
                          f"give --hostfile, or run `gigatron launch --num_nodes {req.num_nodes} "
                          f"--node_rank K --master_addr NODE0 ...` on each node K")
    slots = next(iter(local.values()))
    return {f"node{k}": list(slots) for k in range(req.num_nodes)}


def _resources(req: LaunchRequest, machine: Machine) -> Tuple[Resources, bool, List[str]]:
    listed = _listed_hosts(req)
    if listed is not None:
        source = f"hostfile {req.hostfile}" if req.hosts == "" else f"-H {req.hosts}"
        pool = {host: list(range(slots)) for host, slots in listed.items()}
        active = filter_resources(pool, req.include, req.exclude)
        return _limit(active, req, source, True), True, []
    local, pin, notes = _local_pool(req, machine)
    source = "this machine" if machine.gpus else "--num_gpus/-np"
    if req.num_nodes > 1:
        per_node = _limit(local, replace(req, num_nodes=-1, np=-1), source, machine.gpus > 0)
        return _replicated_nodes(per_node, req), pin, notes
    active = filter_resources(local, req.include, req.exclude)
    return _limit(active, req, source, machine.gpus > 0), pin, notes


def _master_addr(req: LaunchRequest, launcher: str, nodes: Tuple[NodePlan, ...]) -> str:
    """--master_addr, else 127.0.0.1 for a run on this machine, else the first host's name.

    DeepSpeed asks the first host for its address over ssh (`hostname -I`); we use its name,
    which pdsh/ssh/mpirun resolve already.
    """
    if req.master_addr:
        return req.master_addr
    if launcher == "slurm":
        return ""
    listed = req.hostfile_text is not None or bool(req.hosts)
    if not listed or len(nodes) == 1 or nodes[0].host == "localhost":
        return "127.0.0.1"
    return nodes[0].host


def _nodes(resources: Resources, pin: bool) -> Tuple[NodePlan, ...]:
    nodes, first = [], 0
    for index, (host, slots) in enumerate(resources.items()):
        nodes.append(NodePlan(index, host, len(slots), first, tuple(slots) if pin else None))
        first += len(slots)
    return tuple(nodes)


def make_plan(req: LaunchRequest, machine: Machine) -> LaunchPlan:
    """The whole job, node by node, from the flags and what this machine has."""
    check_request(req)
    port = DEFAULT_MASTER_PORT if req.master_port is None else req.master_port
    if req.launcher == "slurm" and req.hostfile_text is None and not req.hosts:
        return LaunchPlan((), "slurm", req.master_addr, port, None)
    resources, pin, notes = _resources(req, machine)
    nodes = _nodes(resources, pin)
    launcher = req.launcher or ("torchrun" if req.node_rank >= 0 or len(nodes) == 1
                                else "pdsh")
    local_node: Optional[int] = None
    if launcher == "torchrun":
        if req.node_rank >= len(nodes):
            raise LaunchError(f"--node_rank {req.node_rank} but the job has {len(nodes)} "
                              f"node(s): give 0..{len(nodes) - 1}")
        local_node = req.node_rank if req.node_rank >= 0 else (0 if len(nodes) == 1 else None)
    if launcher == "mpich" and len({node.nproc for node in nodes}) > 1:
        shape = ", ".join(f"{node.host} {node.nproc}" for node in nodes)
        raise LaunchError(f"--launcher mpich needs the same number of slots on every node "
                          f"(mpirun -ppn); the job has {shape}: even out the hostfile")
    return LaunchPlan(nodes, launcher, _master_addr(req, launcher, nodes),
                      port, local_node, tuple(notes + _restart_notes(req)))


def _restart_notes(req: LaunchRequest) -> List[str]:
    """A restart resumes only what the script loads: Megatron's --save without --load
    would start the job again from scratch."""
    def given(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in req.script_args)

    if req.max_restarts and given("--save") and not given("--load"):
        return [f"--max_restarts {req.max_restarts}: the script has --save but no --load, so "
                f"a restart trains from scratch; give --load the same folder as --save"]
    return []
