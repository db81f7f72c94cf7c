"""Several nodes: one job over two torchrun agents, and `gigatron launch` over a hostfile.

Two torchrun agents on this machine stand for two nodes (--nnodes 2 --rdzv-backend c10d, 2
ranks each): they rendezvous and train one tp2 x pp2 job of 4 ranks. Each agent is torchrun
itself, its command line parsed by torchrun's own parser and run by the same elastic agent,
in a fresh Python process (an agent forked from the test's long-lived, many-threaded process
could hang on a lock a thread held at the fork); only the entry point differs:
`pretrain.main` instead of pretrain_gpt.py, so that the agent forks its workers (torchrun's
--start-method fork) with torch and gigatron already imported (a fresh program per rank
costs seconds of imports).
`gigatron launch --dry_run` over a hostfile of two local "nodes" prints the pdsh and ssh
commands each node would run.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time


from gigatron.cli.launch import main as launch_main
from gigatron.parallel.launcher.commands import EXPORT_PREFIXES
from multirank import free_port

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data "
         "--vocab-size 128 --make-vocab-size-divisible-by 8 --log-interval 1 --eval-iters 0 "
         "--no-progress --num-workers 0 --tensor-model-parallel-size 2 "
         "--pipeline-model-parallel-size 2").split()


# one node's torchrun agent (`torchrun ARGV` with pretrain.main for the program)
AGENT = """
import json, sys
from torch.distributed.launcher.api import elastic_launch
from torch.distributed.run import config_from_args, get_args_parser
from gigatron.training.run import pretrain
import torch
torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # its lazy imports, before the forks
torchrun_argv, flags = json.loads(sys.argv[1])
try:
    config, _, _ = config_from_args(get_args_parser().parse_args(torchrun_argv))
    codes = elastic_launch(config, pretrain.main)(flags)
    sys.exit(0 if set(codes.values()) == {0} else 1)
except Exception as err:  # ChildFailedError: the agent reported the rank's failure
    sys.exit(f"agent failed: {err}")
"""
AGENT_TIMEOUT_S = 120  # a hung job fails the test within this bound, every agent killed


def test_two_torchrun_agents_with_c10d_rendezvous_train_one_tp2_pp2_job(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = []
    for node in range(2):  # each agent keeps its workers' output in its own --log-dir
        argv = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode-test", "--start-method",
                "fork", "--redirects", "3", "--log-dir", str(tmp_path / f"node{node}"),
                "pretrain_gpt.py"]
        # one intra-op thread per worker, set before the agent imports torch (torchrun's own
        # default comes after that import, too late for the forked workers): 4 workers on 2
        # cores only spin against each other otherwise (18.8 -> 14.0 CPU-s for this file)
        with open(tmp_path / f"agent{node}", "w") as log:
            agents.append(subprocess.Popen(
                [sys.executable, "-c", AGENT, json.dumps([argv, FLAGS])], stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1"}))
    deadline = time.monotonic() + AGENT_TIMEOUT_S
    try:
        for agent in agents:
            agent.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.wait()
    agent_logs = [(tmp_path / f"agent{node}").read_text() for node in range(2)]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(t[-3000:] for t in agent_logs)
    # each agent ran two of the job's workers (local ranks 0 and 1) ...
    outputs = []
    for node in range(2):
        logs = sorted((tmp_path / f"node{node}").glob("**/stdout.log"))
        assert sorted(log.parent.name for log in logs) == ["0", "1"], logs
        outputs += [log.read_text() for log in logs]
    # ... and global rank 0, on one of them, reports one job of 4 ranks
    (out,) = [t for t in outputs if t.startswith("gigatron: 4 ranks (torchrun)")]
    assert out.startswith("gigatron: 4 ranks (torchrun) on cpu, tp=2 pp=2 dp=1"), out[-3000:]
    losses = re.findall(r"iteration +(\d)/2 .*? lm loss: (\S+) ", out)
    assert [i for i, _ in losses] == ["1", "2"] and all(0 < float(v) < 10 for _, v in losses)
    assert "done: iteration 2" in out


def _dry_run(tmp_path, capsys, monkeypatch, launcher):
    # the commands carry this environment's NCCL_*/PYTHON*/... variables: pin them
    for name in [k for k in os.environ if k.startswith(EXPORT_PREFIXES)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    assert launch_main(["--hostfile", str(hostfile), "--launcher", launcher,
                        "--master_port", "29700", "--dry_run", "pretrain_gpt.py", "--lr",
                        "1e-3"]) == 0
    return capsys.readouterr().out.splitlines()


# what each node runs: the agent (python -u -m <gigatron's node module>) and its options
def _node_command(node_rank):
    return (rf"cd {{cwd}} && PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 "
            rf"CUDA_VISIBLE_DEVICES=0,1 \S+ -u -m gigatron\.parallel\.launcher\.\w+ "
            rf"--nnodes=2 --node-rank={node_rank} --nproc-per-node=2 "
            rf"--master-addr=127\.0\.0\.1 --master-port=29700 "
            rf"-m gigatron\.parallel\.launcher\.worker pretrain_gpt\.py --lr 1e-3")


def test_pdsh_dry_run_over_two_local_nodes_is_one_command_for_both(tmp_path, capsys,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = _dry_run(tmp_path, capsys, monkeypatch, "pdsh")
    assert out[:2] == ["# gigatron launch: 4 rank(s) on 2 node(s), launcher pdsh, master "
                       "127.0.0.1:29700", "# nodes 0-1 (localhost,127.0.0.1) over pdsh"]
    node = _node_command("%n").replace("{cwd}", re.escape(str(tmp_path)))
    assert len(out) == 3 and re.fullmatch(
        rf"PDSH_RCMD_TYPE=ssh pdsh -S -f 1024 -w localhost,127\.0\.0\.1 '{node}'", out[2]), out


def test_ssh_dry_run_over_two_local_nodes_is_one_command_per_node(tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = _dry_run(tmp_path, capsys, monkeypatch, "ssh")
    assert out[0] == ("# gigatron launch: 4 rank(s) on 2 node(s), launcher ssh, master "
                      "127.0.0.1:29700")
    assert out[1::2] == ["# node 0 (localhost) over ssh", "# node 1 (127.0.0.1) over ssh"]
    for rank, (host, line) in enumerate(zip(["localhost", "127.0.0.1"], out[2::2])):
        node = _node_command(rank).replace("{cwd}", re.escape(str(tmp_path)))
        assert re.fullmatch(rf"ssh {re.escape(host)} '{node}'", line), line
