"""Start a training script on N ranks and nodes with DeepSpeed's launcher flags (and Horovod's)."""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

PROG = "gigatron launch"
DEEPSPEED_HOSTFILE = "/job/hostfile"  # DeepSpeed's default, used when it exists
ENV_FILE_NAME = os.environ.get("DS_ENV_FILE", ".deepspeed_env")

if TYPE_CHECKING:  # the launcher modules import at run time, keeping `gigatron --help` fast
    from gigatron.parallel.launcher.commands import Command
    from gigatron.parallel.launcher.plan import LaunchPlan, LaunchRequest, Machine


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each default once: flags whose help explains their default keep that text;
    a flag's dash/underscore twin (--num-gpus for --num_gpus) is accepted, not listed."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        text = action.help or ""
        return text if "default:" in text else super()._get_help_string(action)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        shown = [s for i, s in enumerate(action.option_strings)
                 if s.replace("-", "_") not in
                 {t.replace("-", "_") for t in action.option_strings[:i]}]
        return super()._format_action_invocation(
            argparse.Action(shown, action.dest, action.nargs, metavar=action.metavar)
            if shown != action.option_strings else action)


class _LaunchParser(argparse.ArgumentParser):
    """An unknown flag is one error line naming the nearest known spelling."""

    def parse_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                   namespace: Optional[argparse.Namespace] = None) -> argparse.Namespace:
        from gigatron.training.config.spelling import nearest

        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            known = [s for a in self._actions for s in a.option_strings]
            names = [u.split("=")[0] for u in unknown if u.startswith("-")] or unknown[:1]
            hints = [f"{close} for {name}" if len(names) > 1 else close
                     for name in names for close in [nearest(name, known)] if close]
            hint = f"; did you mean {', '.join(hints)}?" if hints else ""
            if len(hints) < len(names):
                hint += f"; see {self.prog} --help"
            self.error(f"unknown flag(s) {' '.join(unknown)}{hint}")
        return parsed


def _both(*names: str) -> List[str]:
    """Each flag as spelt and with its other separator: DeepSpeed writes --num_gpus,
    torchrun --nproc-per-node; either spelling is accepted for each."""
    spellings: List[str] = []
    for name in names:
        for spelling in (name, "--" + name[2:].replace("_", "-"),
                         "--" + name[2:].replace("-", "_")):
            if spelling not in spellings:
                spellings.append(spelling)
    return spellings


def _per_node(text: str) -> int:
    """torchrun's --nproc-per-node: a count, or auto/gpu for every GPU (-1, the default)."""
    if text in ("auto", "gpu"):
        return -1
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    """DeepSpeed's `deepspeed` flags with their defaults, plus Horovod's -np and -H."""
    parser = _LaunchParser(
        prog=PROG, allow_abbrev=False, formatter_class=_HelpFormatter,
        description="Start SCRIPT on every rank: one node through torch's elastic agent "
                    "(torchrun), several over pdsh/ssh (torchrun per node), mpirun or srun. "
                    "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
                    "and --local_rank=K (not the gigatron command). Each flag takes either "
                    "separator (--num-gpus, --nproc-per-node). See docs/LAUNCH.md.")
    add = parser.add_argument
    add(*_both("--num_gpus", "--num_accelerators", "--nproc_per_node"), dest="num_gpus",
        type=_per_node, default=-1, metavar="N",
        help="ranks per node (devices 0..N-1); without a GPU, N CPU workers on gloo "
             "(torchrun's --nproc-per-node)")
    add(*_both("--num_nodes", "--nnodes"), dest="num_nodes", type=int, default=-1, metavar="N",
        help="use the first N hosts of the hostfile (torchrun's --nnodes: N nodes, each "
             "started with --node_rank)")
    add("-np", dest="np", type=int, default=-1, metavar="N",
        help="Horovod: number of processes in all (fills the hosts' slots in order); as "
             "with horovodrun, the script gets no --local_rank (LOCAL_RANK is set)")
    add("--hostfile", default=None, metavar="F",
        help=f"`HOST slots=N` per line (default: {DEEPSPEED_HOSTFILE} if it exists, "
             f"else this machine only)")
    add("-H", "--hosts", dest="hosts", default="", metavar="HOSTS",
        help="Horovod's host list `h1:2,h2:2` (a path to a file is read as --hostfile, "
             "as DeepSpeed's -H)")
    add("-i", "--include", default="", metavar="S", help="only these hosts/devices: `h1:0,1@h2`")
    add("-e", "--exclude", default="", metavar="S", help="all but these hosts/devices: `h1:0@h3`")
    add(*_both("--master_addr"), default="", metavar="A",
        help="rank 0's host (default: 127.0.0.1 on one machine, else the first host)")
    add(*_both("--master_port"), type=int, default=None, metavar="P",
        help="rendezvous port on the master (default: 29500; on one machine, a free port "
             "when 29500 is taken, and a line says which)")
    add("--launcher", type=str.lower, default="", metavar="NAME",
        help="torchrun, pdsh, ssh, openmpi, mpich or slurm (default: torchrun here for "
             "one node or --node_rank, pdsh for several)")
    add(*_both("--launcher_args"), default="", metavar="ARGS",
        help="extra arguments for pdsh/ssh/mpirun/srun, quoted")
    add(*_both("--node_rank"), type=int, default=-1, metavar="K",
        help="run only node K's part here (start each node yourself, same master)")
    add(*_both("--no_local_rank"), action="store_true",
        help="do not pass --local_rank=K to the script")
    add(*_both("--log_dir"), default=None, metavar="D",
        help="one log per rank, D/rank{RANK}.log (their output leaves the console)")
    add(*_both("--max_restarts"), type=int, default=0, metavar="N",
        help="after a rank fails (or the watchdog ends a hang), start the job again up to N "
             "times; it resumes from its latest checkpoint when --load is the --save folder "
             "(torchrun's --max-restarts)")
    add("--timeline", default=None, metavar="F",
        help="merged Chrome-trace timeline: sets GIGATRON_TIMELINE=F for every rank")
    add(*_both("--dry_run"), action="store_true", help="print the commands per node; start nothing")
    add("script", help="the training script (run with python -u; a bare name not in this "
                       "folder is looked up among the installed scripts, then on PATH), or "
                       "`gigatron` for the gigatron command: `gigatron launch --num_gpus 2 "
                       "gigatron pretrain ...` (no --local_rank: it reads LOCAL_RANK)")
    add("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def _read(path: str, flag: str) -> str:
    from gigatron.parallel.launcher.hosts import LaunchError

    try:
        with open(path) as f:
            return f.read()
    except OSError as error:
        raise LaunchError(f"{flag} {path}: cannot read it ({error.strerror}): give the path "
                          f"of a `HOST slots=N` file") from None


def _hosts_source(args: argparse.Namespace) -> Tuple[Optional[str], str]:
    """(hostfile path or None, Horovod host list): -H takes a file path too (DeepSpeed)."""
    from gigatron.parallel.launcher.hosts import LaunchError

    hostfile, hosts = args.hostfile, args.hosts
    if hosts and (os.sep in hosts or os.path.isfile(hosts)):
        if hostfile:
            raise LaunchError(f"--hostfile {hostfile} and -H {hosts} both name a hostfile: "
                              f"give one of them")
        hostfile, hosts = hosts, ""
    if hostfile is None and not hosts and os.path.isfile(DEEPSPEED_HOSTFILE):
        hostfile = DEEPSPEED_HOSTFILE
    return hostfile, hosts


def request_from_args(args: argparse.Namespace) -> "LaunchRequest":
    """The parsed flags as a LaunchRequest; reads the hostfile, makes paths absolute."""
    from gigatron.parallel.launcher.plan import LaunchRequest

    hostfile, hosts = _hosts_source(args)
    log_dir, timeline = (os.path.abspath(p) if p else None for p in (args.log_dir,
                                                                       args.timeline))
    return LaunchRequest(
        script=args.script, script_args=tuple(args.script_args), num_gpus=args.num_gpus,
        num_nodes=args.num_nodes, np=args.np, hostfile=hostfile,
        hostfile_text=_read(hostfile, "--hostfile" if args.hostfile else "-H")
        if hostfile else None, hosts=hosts,
        include=args.include, exclude=args.exclude, master_addr=args.master_addr,
        master_port=args.master_port, launcher=args.launcher,
        launcher_args=args.launcher_args, node_rank=args.node_rank,
        # Horovod's -np: horovodrun passes no --local_rank, and Horovod scripts do not parse it
        no_local_rank=args.no_local_rank or args.np > 0, log_dir=log_dir, timeline=timeline,
        max_restarts=args.max_restarts)


def _machine(req: "LaunchRequest") -> "Machine":
    """GPUs here (only looked up when the plan needs them) and CUDA_VISIBLE_DEVICES."""
    from gigatron.parallel.launcher.plan import Machine, selects_devices

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if req.hostfile_text is not None or req.hosts or req.launcher == "slurm" or (
            visible and not selects_devices(req)):
        return Machine(0, visible)
    if visible:  # set aside, as DeepSpeed does, so the count and the ids are physical
        del os.environ["CUDA_VISIBLE_DEVICES"]
    import torch

    gpus = torch.accelerator.device_count() if torch.accelerator.is_available() else 0
    return Machine(gpus, visible)


def read_env_files(paths: Sequence[str]) -> Dict[str, str]:
    """DeepSpeed's .deepspeed_env files: `KEY=VALUE` lines forwarded to every node."""
    found: Dict[str, str] = {}
    for path in paths:
        if os.path.isfile(path):
            with open(path) as f:
                for line in f:
                    key, sep, value = line.strip().partition("=")
                    if sep and key and not key.startswith("#"):
                        found[key.strip()] = value.strip()
    return found


def prepare(req: "LaunchRequest") -> Tuple["LaunchPlan", List["Command"]]:
    """The plan and the commands for this request on this machine."""
    from gigatron.parallel.launcher.commands import forwarded_env, launch_commands
    from gigatron.parallel.launcher.plan import make_plan
    from gigatron.parallel.launcher.ports import with_free_master_port

    plan = with_free_master_port(make_plan(req, _machine(req)), req.master_port)
    env_files = [os.path.join(os.path.expanduser("~"), ENV_FILE_NAME), ENV_FILE_NAME]
    exports = forwarded_env(os.environ, read_env_files(env_files))
    by_name = [name for name in ("PATH", "LD_LIBRARY_PATH") if name in os.environ]
    return plan, launch_commands(plan, req, sys.executable, os.getcwd(), exports, by_name)


def dry_run_text(plan: "LaunchPlan", commands: Sequence["Command"]) -> str:
    """What --dry_run prints: a summary line, notes, then each command under its header."""
    size = f"{plan.world_size} rank(s) on {len(plan.nodes)} node(s)" if plan.nodes else \
        "ranks from the SLURM allocation"
    master = f"{plan.master_addr or '<first SLURM node>'}:{plan.master_port}"
    lines = [f"# {PROG}: {size}, launcher {plan.launcher}, master {master}"]
    lines += [f"# note: {note}" for note in plan.notes]
    for command in commands:
        lines += [f"# {command.what}", command.shell()]
    return "\n".join(lines)


def _start(req: "LaunchRequest", plan: "LaunchPlan", commands: List["Command"]) -> int:
    from gigatron.parallel.launcher.hosts import LaunchError
    from gigatron.parallel.launcher.node import run_node
    from gigatron.parallel.launcher.run import run_commands
    from gigatron.parallel.launcher.worker import (find_script, is_gigatron_command,
                                                   script_not_found)

    for note in plan.notes:
        print(f"{PROG}: {note}", file=sys.stderr)
    if req.log_dir:
        print(f"{PROG}: one log per rank in {req.log_dir}/rank{{RANK}}.log", file=sys.stderr)
    if plan.launcher == "torchrun" and not is_gigatron_command(req.script) and \
            find_script(req.script) is None:
        raise LaunchError(script_not_found(req.script))
    if plan.launcher == "torchrun":
        if plan.local_node is None:
            raise LaunchError("--launcher torchrun starts one node here: run it with "
                              "--node_rank K on each node K (--dry_run prints each node's "
                              "command), or use --launcher pdsh/ssh to start them all")
        os.environ.update(dict(commands[0].env))  # CUDA_VISIBLE_DEVICES, GIGATRON_TIMELINE
        return run_node(commands[0].argv[4:])  # after `python -u -m <node module>`
    missing = sorted({c.argv[0] for c in commands if shutil.which(c.argv[0]) is None})
    if missing:
        raise LaunchError(f"--launcher {plan.launcher} needs `{missing[0]}`, which is not on "
                          f"PATH: install it or pick another --launcher")
    ranks_report = plan.launcher in ("openmpi", "mpich", "slurm")
    # pdsh/ssh nodes run torchrun, which restarts each node's part (--max-restarts)
    return run_commands(commands, req.log_dir, ranks_report=ranks_report,
                        max_restarts=req.max_restarts if ranks_report else 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron launch [--num_gpus N | -np N] [--hostfile F] ... script.py [args]`."""
    from gigatron.parallel.launcher.hosts import LaunchError

    args = build_parser().parse_args(argv)
    try:
        req = request_from_args(args)
        plan, commands = prepare(req)
        if args.dry_run:
            print(dry_run_text(plan, commands))
            return 0
        return _start(req, plan, commands)
    except LaunchError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
