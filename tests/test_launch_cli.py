"""`gigatron launch`: DeepSpeed's launcher flags (and Horovod's -np/-H) on torch's elastic agent.

The parsing, the per-node plan and the command lines are pure and checked exhaustively here;
a few whole-program runs start real workers (2 CPU ranks on gloo, two "nodes" on localhost,
a failing rank, mpirun when Open MPI is installed).
"""
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from gigatron.cli.launch import build_parser, dry_run_text, main as launch_main
from gigatron.parallel.launcher.commands import launch_commands
from gigatron.parallel.launcher.hosts import (LaunchError, filter_resources, parse_horovod_hosts,
                                              parse_hostfile, parse_node_specs)
from gigatron.parallel.launcher.plan import LaunchRequest, Machine, make_plan
from gigatron.parallel.launcher.failures import describe_failure, format_report
from gigatron.parallel.launcher.worker import parse_worker_args, rank_env

HOSTFILE = textwrap.dedent("""\
    # three workers
    worker-0 slots=4
    worker-1 slots=4   # the same

    worker-2 slots=2 max_slots=8
""")
PY = "python"
WORKER = "-m gigatron.parallel.launcher.worker"
TORCHRUN = "python -u -m gigatron.parallel.launcher.node"  # torchrun's flags


def plan_of(machine=Machine(), **flags):
    flags.setdefault("script", "train.py")
    return make_plan(LaunchRequest(**flags), machine)


def lines(machine=Machine(), exports=None, **flags):
    flags.setdefault("script", "train.py")
    req = LaunchRequest(**flags)
    plan = make_plan(req, machine)
    return [c.shell() for c in launch_commands(plan, req, PY, "/work", exports or {})]


def hostfile(**flags):
    return dict(hostfile="hf", hostfile_text=HOSTFILE, **flags)


# ---- hostfile, -H, --include/--exclude ---------------------------------------------------

def test_hostfile_skips_comments_blank_lines_and_text_after_slots():
    assert parse_hostfile(HOSTFILE) == {"worker-0": 4, "worker-1": 4, "worker-2": 2}


@pytest.mark.parametrize("text, message", [
    ("worker-0 slots=4\nworker-1 4\n", r"line 2: bad entry 'worker-1 4': write one `HOST slots=N`"),
    ("worker-0\n", r"line 1: bad entry 'worker-0'"),
    ("a slots=2\nb slots=1\na slots=2\n", r"line 3: host 'a' is listed twice"),
    ("a slots=0\n", r"host 'a' has slots=0"),
    ("# nothing\n\n", r"hostfile is empty or not formatted correctly"),
])
def test_bad_hostfiles_are_one_line_naming_the_line(text, message):
    with pytest.raises(LaunchError, match=message) as error:
        parse_hostfile(text)
    assert "\n" not in str(error.value)


def test_horovod_hosts():
    assert parse_horovod_hosts("h1:2,h2:4") == {"h1": 2, "h2": 4}
    assert parse_horovod_hosts("h1,h2:3") == {"h1": 1, "h2": 3}
    for bad, message in [("h1:x", "bad host 'h1:x'"), ("h1:2,h1:2", "listed twice"),
                         ("h1:0", "0 slots"), ("h1:2,", "bad host ''")]:
        with pytest.raises(LaunchError, match=message):
            parse_horovod_hosts(bad)


def test_node_specs_merge_sort_and_deduplicate():
    assert parse_node_specs("a:1,0@b@a:3,1", "--include") == {"a": [0, 1, 3], "b": []}
    for bad in ["a:", "a:1:2", "a:x", "", "a@"]:
        with pytest.raises(LaunchError, match="--include"):
            parse_node_specs(bad, "--include")


POOL = {"w0": [0, 1, 2], "w1": [0, 1], "w2": [0]}


@pytest.mark.parametrize("include, exclude, expected", [
    ("", "", POOL),
    ("w1", "", {"w1": [0, 1]}),
    ("w2@w0:2,0", "", {"w0": [0, 2], "w2": [0]}),  # pool order, not spec order
    ("", "w1", {"w0": [0, 1, 2], "w2": [0]}),
    ("", "w0:1@w2:0", {"w0": [0, 2], "w1": [0, 1]}),
])
def test_include_exclude_follow_deepspeed(include, exclude, expected):
    assert filter_resources(POOL, include, exclude) == expected


@pytest.mark.parametrize("include, exclude, message", [
    ("w0", "w1", "--include and --exclude are mutually exclusive"),
    ("w9", "", "--include: host 'w9' is not in the hostfile"),
    ("", "w1:5", "--exclude: host 'w1' has no slot 5"),
    ("", "w0@w1@w2", "leaves no host to run on"),
])
def test_include_exclude_errors(include, exclude, message):
    with pytest.raises(LaunchError, match=message):
        filter_resources(POOL, include, exclude)


def _specs(pool):
    """Every NODE_SPEC string over a small pool: each host whole or with a slot subset."""
    per_host = []
    for host, slots in pool.items():
        options = [None, host] + [f"{host}:{','.join(map(str, sub))}"
                                  for n in range(1, len(slots) + 1)
                                  for sub in itertools.combinations(slots, n)]
        per_host.append(options)
    for combo in itertools.product(*per_host):
        parts = [part for part in combo if part]
        if parts:
            yield "@".join(parts)


def test_every_include_and_exclude_matches_the_set_model():
    pool = {"a": [0, 1], "b": [0, 1, 2]}
    for spec in _specs(pool):
        chosen = {}
        for part in spec.split("@"):
            host, _, slots = part.partition(":")
            chosen[host] = set(map(int, slots.split(","))) if slots else set(pool[host])
        included = {h: sorted(chosen[h]) for h in pool if h in chosen}
        assert filter_resources(pool, include=spec) == included, spec
        left = {h: [s for s in pool[h] if s not in chosen.get(h, set())] for h in pool}
        left = {h: s for h, s in left.items() if s}
        if left:
            assert filter_resources(pool, exclude=spec) == left, spec
        else:
            with pytest.raises(LaunchError):
                filter_resources(pool, exclude=spec)


# ---- the per-node plan -------------------------------------------------------------------

def _shape(plan):
    return [(n.host, n.first_rank, n.nproc, n.devices) for n in plan.nodes]


@pytest.mark.parametrize("flags, shape", [
    ({}, [("worker-0", 0, 4, (0, 1, 2, 3)), ("worker-1", 4, 4, (0, 1, 2, 3)),
          ("worker-2", 8, 2, (0, 1))]),
    ({"num_nodes": 2}, [("worker-0", 0, 4, (0, 1, 2, 3)), ("worker-1", 4, 4, (0, 1, 2, 3))]),
    ({"num_gpus": 2}, [("worker-0", 0, 2, (0, 1)), ("worker-1", 2, 2, (0, 1)),
                       ("worker-2", 4, 2, (0, 1))]),
    ({"include": "worker-1:1,3@worker-2"}, [("worker-1", 0, 2, (1, 3)),
                                            ("worker-2", 2, 2, (0, 1))]),
    ({"exclude": "worker-0:0@worker-2"}, [("worker-0", 0, 3, (1, 2, 3)),
                                          ("worker-1", 3, 4, (0, 1, 2, 3))]),
    ({"np": 6}, [("worker-0", 0, 4, (0, 1, 2, 3)), ("worker-1", 4, 2, (0, 1))]),
])
def test_hostfile_plans(flags, shape):
    plan = plan_of(**hostfile(**flags))
    assert _shape(plan) == shape
    assert plan.world_size == sum(n for _, _, n, _ in shape)
    assert plan.launcher == "pdsh" and plan.master_addr == shape[0][0]  # first active host
    assert plan.world_info() == {h: list(d) for h, _, _, d in shape}


def test_ranks_are_contiguous_for_every_include():
    pool = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}
    for spec in itertools.islice(_specs(pool), 0, None, 7):
        plan = plan_of(**hostfile(include=spec))
        ranks = [r for node in plan.nodes for r in node.ranks]
        assert ranks == list(range(plan.world_size)), spec
        named = {part.split(":")[0] for part in spec.split("@")}
        assert [n.host for n in plan.nodes] == [h for h in pool if h in named], spec


@pytest.mark.parametrize("machine, flags, shape", [
    (Machine(gpus=0), {"num_gpus": 2}, [("localhost", 0, 2, None)]),  # CPU workers
    (Machine(gpus=0), {"np": 3}, [("localhost", 0, 3, None)]),
    (Machine(gpus=4), {}, [("localhost", 0, 4, (0, 1, 2, 3))]),
    (Machine(gpus=4), {"num_gpus": 2}, [("localhost", 0, 2, (0, 1))]),
    (Machine(gpus=4), {"include": "localhost:1,3"}, [("localhost", 0, 2, (1, 3))]),
    (Machine(gpus=4), {"exclude": "localhost:0"}, [("localhost", 0, 3, (1, 2, 3))]),
    (Machine(gpus=2, visible_devices="5,7"), {}, [("localhost", 0, 2, None)]),  # kept as is
])
def test_single_machine_plans(machine, flags, shape):
    plan = plan_of(machine, **flags)
    assert _shape(plan) == shape
    assert (plan.launcher, plan.local_node, plan.master_addr) == ("torchrun", 0, "127.0.0.1")


def test_visible_devices_are_set_aside_when_flags_choose_devices():
    plan = plan_of(Machine(gpus=8, visible_devices="5,7"), num_gpus=4)
    assert _shape(plan) == [("localhost", 0, 4, (0, 1, 2, 3))]
    assert "CUDA_VISIBLE_DEVICES=5,7 is ignored" in plan.notes[0]


def test_two_nodes_on_localhost_without_hostfile():
    plan = plan_of(Machine(), num_gpus=2, num_nodes=2, node_rank=1, master_port=1234)
    assert _shape(plan) == [("node0", 0, 2, None), ("node1", 2, 2, None)]
    assert (plan.launcher, plan.local_node, plan.master_addr) == ("torchrun", 1, "127.0.0.1")


def test_node_rank_with_a_hostfile_runs_that_hosts_part():
    plan = plan_of(**hostfile(node_rank=2, master_addr="10.0.0.1"))
    assert (plan.launcher, plan.local_node, plan.master_addr) == ("torchrun", 2, "10.0.0.1")
    assert plan.nodes[2].ranks == range(8, 10)


def test_one_host_hostfile_runs_here_like_deepspeed():
    plan = plan_of(hostfile="hf", hostfile_text="gpu-7 slots=8\n")
    assert (plan.launcher, plan.local_node, plan.master_addr) == ("torchrun", 0, "127.0.0.1")


@pytest.mark.parametrize("machine, flags, message", [
    (Machine(), hostfile(num_gpus=2, include="worker-0"),
     "--num_nodes/--num_gpus cannot be combined with --include/--exclude"),
    (Machine(), hostfile(num_nodes=1, exclude="worker-0"), "cannot be combined"),
    (Machine(), hostfile(hosts="a:2"), "--hostfile and -H both list hosts"),
    (Machine(), {"np": 2, "num_gpus": 2}, "-np .* and --num_gpus .* give one"),
    (Machine(), hostfile(launcher="openmpi", include="worker-0"),
     "openmpi does not support --include/--exclude"),
    (Machine(), hostfile(launcher="mpich", num_gpus=2), "mpich does not support --num_nodes"),
    (Machine(), hostfile(launcher="mpich"), "mpich needs the same number of slots"),
    (Machine(), hostfile(launcher="pdsh", node_rank=0), "--node_rank runs this node's part"),
    (Machine(), hostfile(launcher="slurm", include="worker-0:1"), "slurm allocates whole"),
    (Machine(), hostfile(num_nodes=4), "--num_nodes 4 but hostfile hf lists 3 host"),
    (Machine(), hostfile(num_gpus=3), "--num_gpus 3 but hostfile hf gives 'worker-2' 2"),
    (Machine(), hostfile(np=11), "-np 11 but hostfile hf offers 10 slots"),
    (Machine(), hostfile(node_rank=3), "--node_rank 3 but the job has 3 node"),
    (Machine(), {}, "no GPU found on this machine: give --num_gpus N"),
    (Machine(), {"include": "localhost:0"}, "this machine has none"),
    (Machine(), {"num_gpus": 2, "num_nodes": 2}, "no hostfile lists the other nodes"),
    (Machine(), {"np": 4, "num_nodes": 2, "node_rank": 0}, "give --num_gpus"),
    (Machine(gpus=2), {"num_gpus": 4}, "--num_gpus 4 but this machine gives 'localhost' 2"),
    (Machine(), {"num_gpus": 0}, "--num_gpus 0: give a count of at least 1"),
    (Machine(), {"num_gpus": 1, "master_port": 70000}, "--master_port 70000"),
    (Machine(), {"num_gpus": 1, "launcher": "mpi"}, "--launcher 'mpi': choose one of"),
])
def test_refused_combinations_are_one_line(machine, flags, message):
    with pytest.raises(LaunchError, match=message) as error:
        plan_of(machine, **flags)
    assert "\n" not in str(error.value)


# ---- the command lines -------------------------------------------------------------------

def test_single_node_is_torchrun_with_the_worker():
    assert lines(Machine(gpus=2), script_args=("--lr", "1e-3")) == [
        f"CUDA_VISIBLE_DEVICES=0,1 {TORCHRUN} --nnodes=1 --node-rank=0 --nproc-per-node=2 "
        f"--master-addr=127.0.0.1 --master-port=29500 {WORKER} train.py --lr 1e-3"]


def test_worker_options_and_timeline():
    (line,) = lines(num_gpus=2, no_local_rank=True, log_dir="/logs", timeline="/t.json")
    assert line.startswith("GIGATRON_TIMELINE=/t.json " + TORCHRUN)
    assert line.endswith(f"{WORKER} --no_local_rank --log_dir /logs train.py")


def test_pdsh_one_command_for_alike_nodes():
    assert lines(exports={"NCCL_DEBUG": "INFO"}, **hostfile(include="worker-0:0,1@worker-2")) == [
        "PDSH_RCMD_TYPE=ssh pdsh -S -f 1024 -w worker-0,worker-2 'cd /work && NCCL_DEBUG=INFO "
        f"CUDA_VISIBLE_DEVICES=0,1 {TORCHRUN} --nnodes=2 --node-rank=%n --nproc-per-node=2 "
        f"--master-addr=worker-0 --master-port=29500 {WORKER} train.py'"]


def test_pdsh_per_node_when_nodes_differ():
    out = lines(**hostfile(exclude="worker-1:0,3"))
    assert len(out) == 3
    assert "-w worker-1 'cd /work && CUDA_VISIBLE_DEVICES=1,2 " in out[1]
    assert "--node-rank=1 --nproc-per-node=2" in out[1]
    assert "--node-rank=2 --nproc-per-node=2" in out[2]


def test_ssh_per_node_with_launcher_args():
    out = lines(launcher="ssh", launcher_args="-p 2222", **hostfile(num_nodes=2, num_gpus=1))
    assert out == [
        f"ssh -p 2222 worker-{k} 'cd /work && CUDA_VISIBLE_DEVICES=0 {TORCHRUN} --nnodes=2 "
        f"--node-rank={k} --nproc-per-node=1 --master-addr=worker-0 --master-port=29500 "
        f"{WORKER} train.py'" for k in range(2)]


def test_torchrun_launcher_prints_every_nodes_command():
    out = lines(launcher="torchrun", **hostfile(master_port=6000))
    assert [line.split("--node-rank=")[1][0] for line in out] == ["0", "1", "2"]
    assert all("--nnodes=3" in line and "--master-port=6000" in line for line in out)


def test_openmpi_line():
    assert lines(launcher="openmpi", exports={"NCCL_IB_DISABLE": "1"}, **hostfile(np=6)) == [
        "mpirun --allow-run-as-root -np 6 -H worker-0:4,worker-1:2 --bind-to none "
        "-x MASTER_ADDR=worker-0 -x MASTER_PORT=29500 -x NCCL_IB_DISABLE=1 -x PATH "
        f"python -u {WORKER} train.py"]


def test_openmpi_on_this_machine_with_np():
    assert lines(launcher="openmpi", np=2, launcher_args="--oversubscribe") == [
        "mpirun --allow-run-as-root -np 2 -H localhost:2 --bind-to none "
        "-x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 -x PATH --oversubscribe "
        f"python -u {WORKER} train.py"]


def test_mpich_line():
    assert lines(launcher="mpich", hosts="a:2,b:2", master_port=7000, timeline="/t.json") == [
        "mpirun -n 4 -ppn 2 -genv MASTER_ADDR a -genv MASTER_PORT 7000 -genv GIGATRON_TIMELINE "
        f"/t.json -genv WORLD_SIZE 4 -genv LOCAL_SIZE 2 -hosts a,b python -u {WORKER} train.py"]


@pytest.mark.parametrize("flags, expected", [
    ({"num_nodes": 4, "num_gpus": 8},
     "srun --nodes 4 --ntasks-per-node 8 --export=ALL,MASTER_PORT=29500"),
    ({"np": 16, "launcher_args": "--partition gpu"},
     "srun -n 16 --partition gpu --export=ALL,MASTER_PORT=29500"),
    (hostfile(include="worker-0@worker-2"),
     "srun -n 6 --nodelist worker-0,worker-2 --export=ALL,MASTER_PORT=29500"),
    (hostfile(exclude="worker-1", master_addr="head"),
     "srun -n 6 --exclude worker-1 --export=ALL,MASTER_ADDR=head,MASTER_PORT=29500"),
])
def test_slurm_lines(flags, expected):
    assert lines(launcher="slurm", **flags) == [f"{expected} python -u {WORKER} train.py"]


def test_dry_run_prints_a_header_per_command():
    req = LaunchRequest(script="train.py", **hostfile(num_nodes=2, exclude=""))
    plan = make_plan(req, Machine())
    text = dry_run_text(plan, launch_commands(plan, req, PY, "/work", {}))
    assert text.splitlines()[0] == ("# gigatron launch: 8 rank(s) on 2 node(s), launcher pdsh, "
                                    "master worker-0:29500")
    assert "# nodes 0-1 (worker-0,worker-1) over pdsh" in text


def test_cli_dry_run_reads_the_hostfile_and_horovod_flags(tmp_path, capsys):
    (tmp_path / "hf").write_text(HOSTFILE)
    assert launch_main(["-H", str(tmp_path / "hf"), "-np", "5", "--launcher", "openmpi",
                        "--dry_run", "train.py", "--x", "1"]) == 0
    out = capsys.readouterr().out
    assert "-np 5 -H worker-0:4,worker-1:1 --bind-to none" in out
    # Horovod's -np passes no --local_rank to the script, as horovodrun does
    assert out.rstrip().endswith(
        "-m gigatron.parallel.launcher.worker --no_local_rank train.py --x 1")


@pytest.mark.parametrize("argv, message", [
    (["--hostfile", "missing", "x.py"], "--hostfile missing: cannot read it"),
    (["-H", "a:2", "-np", "3", "--dry_run", "x.py"], "-np 3 but -H a:2 offers 2 slots"),
    (["--launcher", "nope", "--num_gpus", "1", "x.py"], "--launcher 'nope': choose one of"),
])
def test_cli_errors_are_one_line_with_exit_code_2(argv, message, capsys, tmp_path,
                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert launch_main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gigatron launch: error: ") and err.count("\n") == 1
    assert re.search(message, err), err


def test_parser_keeps_script_arguments_apart():
    args = build_parser().parse_args(["-np", "2", "train.py", "-np", "9", "--local_rank", "3"])
    assert (args.np, args.script, args.script_args) == (2, "train.py",
                                                        ["-np", "9", "--local_rank", "3"])


@pytest.mark.parametrize("argv", [
    # DeepSpeed's spellings, their dash twins, torchrun's (both separators)
    "--num_gpus 2 --num_nodes 3 --node_rank 1 --master_addr h --master_port 7",
    "--num-gpus 2 --num-nodes 3 --node-rank 1 --master-addr h --master-port 7",
    "--num_accelerators 2 --num-nodes=3 --node_rank=1 --master_addr=h --master-port=7",
    "--nproc_per_node 2 --nnodes 3 --node_rank 1 --master_addr h --master_port 7",
    "--nproc-per-node=2 --nnodes=3 --node-rank=1 --master-addr=h --master-port=7",
])
def test_torchrun_and_deepspeed_spellings_with_either_separator(argv):
    args = build_parser().parse_args(argv.split() + ["train.py", "--nnodes", "9"])
    assert (args.num_gpus, args.num_nodes, args.node_rank, args.master_addr,
            args.master_port, args.script, args.script_args) == (
        2, 3, 1, "h", 7, "train.py", ["--nnodes", "9"])
    flags = "--launcher-args=-q --no-local-rank --log-dir d --max-restarts 1 --dry-run x.py"
    args = build_parser().parse_args(flags.split())
    assert (args.launcher_args, args.no_local_rank, args.log_dir, args.max_restarts,
            args.dry_run) == ("-q", True, "d", 1, True)
    assert build_parser().parse_args(["--nproc-per-node", "gpu", "x.py"]).num_gpus == -1


def test_cli_dry_run_with_torchrun_flags(capsys):
    assert launch_main(["--nproc-per-node", "2", "--master-port", "29731", "--dry-run",
                        "train.py"]) == 0
    out = capsys.readouterr().out
    assert "--nnodes=1 --node-rank=0 --nproc-per-node=2 --master-addr=127.0.0.1 " \
           "--master-port=29731" in out


@pytest.mark.parametrize("argv, hint", [
    (["--nproc_per_nod", "2", "x.py"], "unknown flag(s) --nproc_per_nod; did you mean "
                                       "--nproc_per_node?"),
    (["--num-gpu=2", "x.py"], "unknown flag(s) --num-gpu=2; did you mean --num-gpus?"),
    (["--zzz", "--master-prt", "1", "x.py"], "unknown flag(s) --zzz --master-prt; did you "
     "mean --master-port for --master-prt?; see gigatron launch --help"),
])
def test_unknown_flag_is_one_line_with_the_nearest_flag(argv, hint, capsys):
    with pytest.raises(SystemExit) as exit_:
        launch_main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"gigatron launch: error: {hint}\n" in err, err


def test_busy_default_port_on_one_machine_moves_to_a_free_one_and_says_so(monkeypatch,
                                                                         capsys):
    import gigatron.parallel.launcher.plan as plan_module

    with socket.socket() as held:  # the default port, taken by someone else
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        monkeypatch.setattr(plan_module, "DEFAULT_MASTER_PORT", busy)
        assert launch_main(["--num_gpus", "2", "--dry_run", "train.py"]) == 0
        out = capsys.readouterr().out
        moved = int(re.search(r"--master-port=(\d+)", out).group(1))
        assert moved != busy and f"master 127.0.0.1:{moved}" in out
        assert f"# note: master port {busy} is in use on this machine: using the free port " \
               f"{moved} (--master_port P chooses one)" in out.splitlines()
        for argv in (["--master_port", str(busy)],  # given: kept (the run will say it is taken)
                     ["--nnodes", "2", "--node_rank", "0"]):  # the other node needs the same
            assert launch_main(argv + ["--num_gpus", "1", "--dry_run", "train.py"]) == 0
            out = capsys.readouterr().out
            assert f"--master-port={busy} " in out and "in use" not in out


# ---- the worker's environment and the failure report -------------------------------------

@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
      "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "9"},
     ("3", "4", "1", "2", "1", "2", "h", "9")),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
      "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
      "MASTER_ADDR": "m", "MASTER_PORT": "7"}, ("5", "8", "1", "4", "1", "2", "m", "7")),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
      "MASTER_ADDR": "m"}, ("2", "4", "0", "2", "1", "2", "m", "29500")),
    ({"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NNODES": "2",
      "SLURM_NODEID": "1", "SLURM_NODELIST": "gpu[07-08]"},
     ("6", "8", "2", "4", "1", "2", "gpu07", "29500")),
])
def test_worker_exports_torchrun_variables_under_every_launcher(env, expected):
    got = rank_env(env)
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "CROSS_RANK",
             "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    assert tuple(got[n] for n in names) == expected
    assert got["LOCAL_SIZE"] == got["LOCAL_WORLD_SIZE"]


def test_worker_options_end_at_the_script():
    assert parse_worker_args(["--no_local_rank", "--log_dir", "d", "t.py", "--log_dir", "x"]) \
        == (True, "d", ["t.py", "--log_dir", "x"])
    with pytest.raises(SystemExit, match="unknown option '--bogus'"):
        parse_worker_args(["--bogus", "t.py"])


def test_report_names_the_first_failure_and_not_the_ranks_the_agent_stopped(tmp_path):
    error_file = tmp_path / "e.json"
    error_file.write_text(json.dumps({"message": {"message": "ValueError: bad batch", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  File \"t.py\", line 3, in <module>"
                        "\n    step()\n  File \"t.py\", line 2, in step\n    raise ValueError("
                        "'bad batch')\nValueError: bad batch\n", "timestamp": "5", "time": 5.2}}}))
    failures = [describe_failure(1, 1, str(error_file), None),
                describe_failure(0, -15, None, None, when=6)]
    assert format_report(failures).splitlines() == [
        "gigatron launch: rank 1 failed (ValueError: bad batch); the other ranks were stopped",
        "  |   File \"t.py\", line 2, in step", "  |     raise ValueError('bad batch')",
        "  | ValueError: bad batch"]


def test_report_without_traceback_shows_the_exit_and_log_tail(tmp_path):
    (tmp_path / "rank2.log").write_text("step 1\nstep 2\n\nout of memory\n")
    report = format_report([describe_failure(2, -9, None, str(tmp_path))])
    assert report.splitlines()[0] == "gigatron launch: rank 2 failed (killed by SIGKILL); " \
                                     "the other ranks were stopped"
    assert "  | out of memory" in report and f"its log: {tmp_path}/rank2.log" in report


# ---- whole programs: real workers on this machine ----------------------------------------

ALLREDUCE = textwrap.dedent("""\
    import argparse, os, sys
    import torch, torch.distributed as dist
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    sys.stdout.write(f"rank={dist.get_rank()} world={dist.get_world_size()} "
                     f"local_rank={args.local_rank} env_local_rank={os.environ['LOCAL_RANK']} "
                     f"sum={int(total.item())} tag={args.tag} "
                     f"timeline={os.environ.get('GIGATRON_TIMELINE')}\\n")  # one write per line
    dist.destroy_process_group()
""")
# Rank 1 fails once every rank is up; rank 0 waits to be stopped. The ranks meet at a file
# barrier, not torch's: what is tested is the launcher's report, and importing torch cost
# each rank ~2 CPU-s (~4 of each failing run's ~5).
FAILING = textwrap.dedent("""\
    import os, time
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    open(f"up{rank}", "w").close()
    while not all(os.path.exists(f"up{r}") for r in range(world)):
        time.sleep(0.05)
    def step(rank):
        raise ValueError(f"rank {rank} cannot go on: bad batch")
    if rank == 1:
        step(1)
    time.sleep(60)
""")


def rank_lines(text):
    """The scripts' report lines, sorted (ranks share one pipe, so split at each report)."""
    return sorted(re.findall(r"rank=\d+ .*?timeline=\S*?(?=rank=|\n|$)", text))


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(tmp_path, *args, wait=True):
    (tmp_path / "allreduce.py").write_text(ALLREDUCE)
    (tmp_path / "failing.py").write_text(FAILING)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}  # CPU workers
    argv = [sys.executable, "-m", "gigatron", "launch", *args]
    if not wait:
        return subprocess.Popen(argv, cwd=tmp_path, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(argv, cwd=tmp_path, env=env, text=True, capture_output=True,
                          timeout=180)


def test_one_node_two_cpu_workers_all_reduce(tmp_path):
    proc = launch(tmp_path, "--num_gpus", "2", "--master_port", str(free_port()),
                  "--timeline", "t.json", "allreduce.py", "--tag", "one")
    assert proc.returncode == 0, proc.stderr
    timeline = tmp_path / "t.json"
    assert rank_lines(proc.stdout) == [
        f"rank={r} world=2 local_rank={r} env_local_rank={r} sum=3 tag=one timeline={timeline}"
        for r in range(2)]
    assert "torch.distributed" not in proc.stderr and "OMP_NUM_THREADS" not in proc.stderr


def test_two_nodes_on_localhost_with_node_rank_and_per_rank_logs(tmp_path):
    common = ["--num_gpus", "1", "--num_nodes", "2", "--master_port", str(free_port()),
              "--log_dir", "logs"]
    node0 = launch(tmp_path, *common, "--node_rank", "0", "allreduce.py", "--tag", "n0",
                   wait=False)
    node1 = launch(tmp_path, *common, "--node_rank", "1", "allreduce.py", "--tag", "n1")
    out0, err0 = node0.communicate(timeout=180)
    assert (node0.returncode, node1.returncode) == (0, 0), err0 + node1.stderr
    for rank in range(2):
        log = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        assert f"rank={rank} world=2 local_rank=0 env_local_rank=0 sum=3 tag=n{rank}" in log
    assert "rank=" not in out0 + node1.stdout  # the ranks' output went to their logs


def test_failing_rank_stops_the_job_with_a_short_report(tmp_path):
    proc = launch(tmp_path, "--num_gpus", "2", "--master_port", str(free_port()),
                  "--no_local_rank", "failing.py")
    assert proc.returncode == 1
    err = proc.stderr
    assert err.count("ValueError: rank 1 cannot go on: bad batch") == 3  # traceback, report
    assert "gigatron launch: rank 1 failed (ValueError: rank 1 cannot go on: bad batch); " \
           "the other ranks were stopped" in err
    for agent_noise in ("ChildFailedError", "Root Cause", "torch/distributed", "elastic"):
        assert agent_noise not in err, err
    assert len(err.splitlines()) <= 12, err


needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None,
                                  reason="Open MPI's mpirun is not installed")


@needs_mpirun
def test_mpirun_np_2_all_reduces(tmp_path):
    proc = launch(tmp_path, "--launcher", "openmpi", "-np", "2", "--master_port",
                  str(free_port()), "allreduce.py", "--tag", "mpi")
    assert proc.returncode == 0, proc.stderr
    assert rank_lines(proc.stdout) == [  # Horovod's -np: no --local_rank flag, LOCAL_RANK set
        f"rank={r} world=2 local_rank=-1 env_local_rank={r} sum=3 tag=mpi timeline=None"
        for r in range(2)]


@needs_mpirun
def test_mpirun_failure_names_the_rank(tmp_path):
    proc = launch(tmp_path, "--launcher", "openmpi", "-np", "2", "--master_port",
                  str(free_port()), "--no_local_rank", "failing.py")
    assert proc.returncode == 1
    assert "gigatron launch: rank 1 failed (ValueError: rank 1 cannot go on: bad batch)" \
        in proc.stderr


def test_missing_script_is_one_line_before_any_worker_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert launch_main(["--num_gpus", "1", "nope.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gigatron launch: error: script 'nope.py' not found in {tmp_path}, "
                          f"in ") and err.endswith(" or on PATH: give its path (the gigatron "
                                                   "command: `gigatron launch ... gigatron "
                                                   "pretrain ...`)\n"), err


def test_ssh_command_lines_run_as_printed(tmp_path, monkeypatch):
    """Two "nodes" over ssh, where a stand-in ssh runs the remote command on this machine:
    the quoting, `cd`, variables and per-node torchrun of the printed lines really work."""
    fake = tmp_path / "bin" / "ssh"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\nexec bash -c "${@: -1}"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")
    proc = launch(tmp_path, "-H", "localhost:1,127.0.0.1:1", "--launcher", "ssh",
                  "--master_port", str(free_port()), "allreduce.py", "--tag", "it's")
    assert proc.returncode == 0, proc.stderr
    assert rank_lines(proc.stdout) == [
        f"rank={r} world=2 local_rank=0 env_local_rank=0 sum=3 tag=it's timeline=None"
        for r in range(2)]
