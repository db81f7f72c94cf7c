"""A job whose rank dies starts again from its latest checkpoint and ends as if nothing
happened: `gigatron launch --max_restarts N` end to end (issue 30), and `torchrun
--max-restarts` through our process-group initialisation.

The uninterrupted baseline runs on forked ranks (cheap); the restarted run goes through the
launcher: rank 1 SIGKILLs itself as it starts iteration 10 of 13 on the first attempt
(GIGATRON_KILL_RANK_AT), with persistent checkpoints every 5 iterations and in-memory
non-persistent ones every 2 (a tmpfs-like folder of the test), so the restart must resume
from the in-memory checkpoint of iteration 8, newer than the persistent one of 5, then
train 9-13 through a persistent (10) and an in-memory (12) save. 13 iterations, not 16: a
rank's start costs ~3.5 CPU-s, each of its iterations ~0.05 (~0.6 CPU-s less).
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from test_training_loop import _program_on

from gigatron.parallel.launcher.commands import torchrun_argv
from gigatron.parallel.launcher.hosts import LaunchError
from gigatron.parallel.launcher.plan import LaunchRequest, Machine, make_plan
from gigatron.parallel.launcher.progress import inject_fault, iterations_lost
from gigatron.parallel.world import attempt_store, read_launch_env

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --mock-data --vocab-size 128 "
         "--make-vocab-size-divisible-by 8 --log-interval 1 --eval-iters 0 --no-progress "
         "--train-iters 13 --save-interval 5 --num-workers 0").split()
RUN_TIMEOUT_S = 240  # a hung launch fails the test instead of the suite


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(tmp_path, *args, env=None):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env or {})}
    argv = [sys.executable, "-m", "gigatron", "launch", "--num_gpus", "2", "--master_port",
            str(_free_port()), *args]
    return subprocess.run(argv, cwd=tmp_path, env=env, text=True, capture_output=True,
                          timeout=RUN_TIMEOUT_S)


def _train_losses(metrics_path):
    with open(metrics_path) as f:
        records = [json.loads(line) for line in f]
    return [(r["iteration"], r["lm loss"]) for r in records if r["type"] == "train"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """{iteration: loss} of the run that nothing interrupts (2 forked ranks, dp 2)."""
    import gigatron.training.run.pretrain  # noqa: F401 -- the forked ranks share the import
    folder = tmp_path_factory.mktemp("uninterrupted")
    metrics = str(folder / "m.jsonl")
    results = _program_on(2, FLAGS + ["--save", str(folder / "ckpt"), "--metrics-file",
                                      metrics], timeout=RUN_TIMEOUT_S)
    assert [r[0] for r in results] == [0, 0], results
    losses = dict(_train_losses(metrics))
    assert sorted(losses) == list(range(1, 14))
    return losses


def _console_losses(text):
    """(iteration, loss) of every console log line, in order (a restart repeats some)."""
    return [(int(i), float(loss)) for i, loss in
            re.findall(r"iteration +(\d+)/ *13 \|.*?lm loss: ([0-9.E+-]+)", text)]


@pytest.mark.e2e
def test_kill_9_at_iteration_10_restarts_and_logs_the_uninterrupted_losses(
        tmp_path, uninterrupted):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    memory = tmp_path / "shm"
    memory.mkdir()
    proc = _launch(tmp_path, "--max_restarts", "1", "gigatron", "pretrain", *FLAGS,
                   "--save", ckpt, "--load", ckpt, "--metrics-file", metrics,
                   "--non-persistent-save-interval", "2", "--non-persistent-ckpt-type",
                   "in_memory", "--non-persistent-local-ckpt-dir", str(memory),
                   env={"GIGATRON_KILL_RANK_AT": "1:10"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    restart = [line for line in proc.stderr.splitlines() if "restart" in line]
    assert restart == ["gigatron launch: rank 1 failed (killed by SIGKILL); restart 1 of 1 "
                       "from the latest checkpoint: 1 iteration lost (last logged iteration "
                       "9, checkpoint at iteration 8)"], proc.stderr[-3000:]
    assert "in_memory non-persistent) (iteration 8," in proc.stdout, proc.stdout[-3000:]
    console = _console_losses(proc.stdout)
    # iterations 1-9, then the restart from iteration 8's in-memory checkpoint: 9-13
    assert [i for i, _ in console] == list(range(1, 10)) + list(range(9, 14)), proc.stdout
    for iteration, loss in console:  # the console prints 7 significant digits
        assert loss == pytest.approx(uninterrupted[iteration], rel=1e-6, abs=0), iteration
    # the metrics file keeps full precision; the resume dropped the lines after iteration 8
    assert _train_losses(metrics) == sorted(uninterrupted.items())
    assert "loaded checkpoint" in proc.stdout


ALWAYS_FAILING = textwrap.dedent("""\
    import os, signal, time
    if os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)  # rank 0 waits to be stopped
""")


@pytest.mark.e2e
def test_a_job_that_fails_every_time_stops_after_max_restarts_naming_the_failure(tmp_path):
    (tmp_path / "dies.py").write_text(ALWAYS_FAILING)
    proc = _launch(tmp_path, "--max_restarts", "1", "--no_local_rank", "dies.py")
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gigatron launch")]
    assert lines == [
        "gigatron launch: rank 1 failed (killed by SIGKILL); restart 1 of 1 from the latest "
        "checkpoint: no iteration was logged",
        "gigatron launch: rank 1 failed (killed by SIGKILL); the other ranks were stopped",
        "gigatron launch: no restart left after 1 (--max_restarts 1): the failure above ends "
        "the job"], proc.stderr[-3000:]


# ---- the pieces, without processes ---------------------------------------------------------

def test_each_torchrun_attempt_meets_under_its_own_store_prefix():
    """torchrun's agent keeps its store across --max-restarts: attempt 1 must not read
    attempt 0's addresses (the cause of 'Gloo connectFullMesh failed ... refused')."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(server.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    launch, timeout = read_launch_env(env), timedelta(seconds=10)
    first = attempt_store(launch, {**env, "TORCHELASTIC_RESTART_COUNT": "0"}, timeout)
    first.set("default_pg/0//cpu//0/0", "a dead rank's address")
    second = attempt_store(launch, {**env, "TORCHELASTIC_RESTART_COUNT": "1"}, timeout)
    assert not second.check(["default_pg/0//cpu//0/0"])
    assert first.check(["default_pg/0//cpu//0/0"])
    # without the agent's store (no torchrun, or TORCH_DISABLE_SHARE_RDZV_TCP_STORE) torch's
    # own rendezvous is used: rank 0 hosts a new store each attempt
    assert attempt_store(launch, {**env, "TORCHELASTIC_USE_AGENT_STORE": "False"},
                         timeout) is None


def test_the_fault_acts_on_its_rank_and_iteration_of_the_first_attempt_only(monkeypatch):
    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(sig))
    env = {"GIGATRON_KILL_RANK_AT": "1:10", "RANK": "1"}
    for iteration, extra in ((9, {}), (10, {"RANK": "0"}), (10, {"GIGATRON_RESTART_COUNT": "1"}),
                             (10, {"TORCHELASTIC_RESTART_COUNT": "1"})):
        inject_fault(iteration, {**env, **extra})
    assert killed == []
    inject_fault(10, env)
    assert killed == [signal.SIGKILL]


def test_iterations_lost_is_last_logged_minus_checkpoint():
    assert iterations_lost({"logged": 9, "saved": 5}) == \
        "4 iterations lost (last logged iteration 9, checkpoint at iteration 5)"
    assert iterations_lost({"logged": 5, "saved": 5}).startswith("0 iterations lost")
    assert iterations_lost({"logged": 3}).startswith("last logged iteration 3, no checkpoint")
    assert iterations_lost({}) == "no iteration was logged"


def _plan(*script_args, restarts=1):
    req = LaunchRequest(script="gigatron", script_args=("pretrain",) + script_args,
                        num_gpus=2, max_restarts=restarts)
    return req, make_plan(req, Machine(0))


def test_max_restarts_reaches_torchrun_and_a_missing_load_is_noted():
    req, plan = _plan("--save", "ck", "--load", "ck")
    assert "--max-restarts=1" in torchrun_argv(plan, plan.nodes[0], req, "python")
    assert plan.notes == ()
    req, plan = _plan("--save", "ck", restarts=0)
    assert not any("restarts" in a for a in torchrun_argv(plan, plan.nodes[0], req, "python"))
    _, plan = _plan("--save=ck")
    assert plan.notes == ("--max_restarts 1: the script has --save but no --load, so a "
                          "restart trains from scratch; give --load the same folder as --save",)
    with pytest.raises(LaunchError, match=r"^--max_restarts -1: give how many times"):
        _plan(restarts=-1)


def test_a_killed_rank_is_named_before_the_peer_whose_collective_failed_after(tmp_path):
    from gigatron.parallel.launcher.failures import describe_failure, first_failures

    error_file = tmp_path / "e.json"  # rank 0's all-reduce failed 0.3 s into second 12
    error_file.write_text(json.dumps({"message": {"message": "RuntimeError: Connection closed "
                                      "by peer", "extraInfo": {"py_callstack": "", "time": 12.3}}}))
    # the agent noticed rank 1's SIGKILL in second 13 (its timestamps are whole seconds)
    failures = [describe_failure(0, 1, str(error_file), None),
                describe_failure(1, -signal.SIGKILL, None, None, when=13)]
    assert [f.rank for f in first_failures(failures)] == [1, 0]


def test_with_per_rank_logs_a_rank_the_agent_stopped_is_not_taken_for_the_failure(tmp_path):
    from gigatron.parallel.launcher.failures import describe_failure, first_failures

    (tmp_path / "rank0.log").write_text("iteration 9\n")  # rank 1 died before any line
    failures = [describe_failure(0, -signal.SIGTERM, None, str(tmp_path), when=12),
                describe_failure(1, -signal.SIGKILL, None, str(tmp_path), when=12)]
    assert [f.rank for f in first_failures(failures)] == [1]


def test_after_a_hang_the_report_and_restart_line_name_the_watchdog_verdict(tmp_path,
                                                                           monkeypatch):
    """The watchdog's reporter leaves its verdict as its error record; the launcher leads
    with it, not with the SIGKILL the watchdog sent the hung rank."""
    from gigatron.parallel.launcher import worker
    from gigatron.parallel.launcher.failures import (describe_failure, format_report,
                                                     restart_line)

    verdict = ("rank 1 (pid 4242 on node) stopped answering: no heartbeat for 6 s (stopped, "
               "dead or frozen); its last heartbeat said: iteration 8. Every rank is ending")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv(worker.ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    monkeypatch.delenv(worker.LOG_DIR_ENV, raising=False)
    worker.record_verdict(verdict)
    failures = [describe_failure(0, 3, str(tmp_path / "rank0.error.json"), None),
                describe_failure(1, -signal.SIGKILL, None, None, when=13)]
    first = format_report(failures, stopped_others=False).splitlines()[0]
    assert first == f"gigatron launch: {verdict}"
    assert restart_line(first, 1, 1, {"logged": 9, "saved": 5}).startswith(
        f"gigatron launch: {verdict}; restart 1 of 1 from the latest checkpoint: 4 iterations")
