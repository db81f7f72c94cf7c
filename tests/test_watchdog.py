"""A hung rank is named, and ends the job within the timeout.

Unit tests drive the watchdog with a dict store and a fake clock-free verdict hook; forked
tests SIGSTOP a real rank: its peers must end within the timeout plus a bounded grace, with
a message naming the stopped rank and what it was doing, and every process group (not only
the world group) must honour --distributed-timeout-minutes.
"""
import json
import os
import signal
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gigatron.parallel import comm
from gigatron.parallel.activity import Activity, activity
from gigatron.parallel.topology import ProcessGroups, Topology
from gigatron.parallel.watchdog import (EXIT_CODE, VERDICT, Watchdog, beat_interval,
                                        key_prefix, watched_peer)
from multirank import RankError, run_on_ranks


class DictStore:
    """The slice of TCPStore's API the watchdog uses."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def compare_set(self, key, expected, desired):
        if key not in self.data and expected == "":
            self.data[key] = desired.encode()
        return self.data[key]


def test_rank_math_is_a_ring_and_intervals_are_bounded():
    assert [watched_peer(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert beat_interval(60) == 5.0 and beat_interval(600) == 5.0
    assert beat_interval(3) == pytest.approx(0.3) and beat_interval(0.1) == 0.1
    # a torchrun restart must not read the verdict of the attempt before it
    assert key_prefix({"TORCHELASTIC_RESTART_COUNT": "1"}) != key_prefix({})


def test_activity_names_iteration_phase_and_the_last_collective():
    a = Activity()
    group = object()
    a.label_group(group, "dp group [0, 2]")
    a.at(7, "train step")
    a.entered("all_reduce", group, 2)
    assert a.describe().startswith("iteration 7, train step, last collective all_reduce "
                                   "over dp group [0, 2] (0 s ago)")
    a.entered("barrier", None, 4)
    assert "barrier over world" in a.describe()


def _watchdogs(store, n, timeout, verdicts):
    return [Watchdog(store, r, n, timeout, "p/", interval_s=0.01,
                     on_verdict=lambda msg, reporter, r=r: verdicts.append((r, reporter, msg)))
            for r in range(n)]


def test_a_peer_that_stops_beating_is_named_with_what_it_was_doing():
    store, verdicts = DictStore(), []
    dogs = _watchdogs(store, 3, 0.2, verdicts)
    activity.at(12, "train step")
    for d in dogs:
        d._publish("running")
    for d in dogs:
        assert d.check() is None  # first sight of each peer starts its clock
    time.sleep(0.25)
    for d in (dogs[0], dogs[2]):  # rank 1 is stopped: it neither beats nor checks
        d._publish("running")
    assert dogs[2].check() is None  # rank 0 is beating
    message = dogs[0].check()
    assert message is not None and message.startswith(f"rank 1 (pid {os.getpid()} on ")
    assert "stopped answering: no heartbeat for 0 s" in message
    assert "iteration 12, train step" in message and "noticed by rank 0" in message
    assert "--distributed-timeout-minutes" in message
    # every live rank reads the same verdict; only the one that noticed reports it
    assert dogs[2].check() == message
    assert [(r, reporter) for r, reporter, _ in verdicts] == [(0, True), (2, False)]


def test_a_finished_or_failed_peer_is_never_called_hung():
    store, verdicts = DictStore(), []
    dogs = _watchdogs(store, 2, 0.05, verdicts)
    dogs[1]._publish("done")
    dogs[0].check()
    time.sleep(0.1)
    assert dogs[0].check() is None
    dogs[1]._publish("failed")
    time.sleep(0.1)
    assert dogs[0].check() is None and verdicts == []


def test_the_first_verdict_stands():
    store, verdicts = DictStore(), []
    store.set("p/" + VERDICT, json.dumps({"message": "rank 3 stopped answering", "by": 2}))
    dog = _watchdogs(store, 4, 10, verdicts)[0]
    assert dog.check() == "rank 3 stopped answering"
    assert verdicts == [(0, False, "rank 3 stopped answering")]


def test_after_a_failed_collective_the_peers_that_stopped_beating_are_named():
    store, verdicts = DictStore(), []
    dogs = _watchdogs(store, 4, 60, verdicts)
    activity.at(3, "train step")
    for d in dogs:
        d._publish("running")
    dogs[3]._publish("failed")
    dogs[2]._thread.start()  # rank 2 keeps beating; rank 1 died (its beats stopped)
    try:
        cause = dogs[0].explain_failure(0.1)
    finally:
        dogs[2].stop()
    assert cause.startswith(f"rank 1 (pid {os.getpid()} on "), cause
    assert "stopped beating: it exited or was killed without a word; its last heartbeat " \
           "said: iteration 3, train step" in cause
    assert "rank 2" not in cause and "rank 3 failed with its own error" in cause
    assert verdicts == []


# -- real ranks -----------------------------------------------------------------------------

def _subgroup_collective_times_out(rank, world_size):
    groups = ProcessGroups(Topology(tp=1, dp=world_size, pp=1), rank,
                           timeout=timedelta(seconds=2))
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # never joins the collective below; stays up until rank 0 has timed out
        store.wait(["timed out"], timedelta(seconds=20))
        return None
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="Timed out"):
            comm.all_reduce(torch.ones(3), group=groups.dp)
    finally:
        store.set("timed out", "1")
    return time.monotonic() - start


def test_every_process_group_gets_the_distributed_timeout():
    # torch gives new_group its own 30-minute default, not the world group's timeout
    waited = run_on_ranks(_subgroup_collective_times_out, 2, timeout=30)[0]
    assert 1.5 < waited < 6, waited


HANG_TIMEOUT_S = 3.0


def _train_until_rank_2_stops(rank, world_size):
    from gigatron.parallel.watchdog import start_watchdog

    groups = ProcessGroups(Topology(tp=1, dp=world_size, pp=1), rank,
                           timeout=timedelta(seconds=60))  # the watchdog must act first
    dog = start_watchdog(rank, world_size, "127.0.0.1", int(os.environ["MASTER_PORT"]),
                         HANG_TIMEOUT_S)
    try:
        for iteration in range(1, 1000):
            activity.at(iteration, "train step")
            if rank == 2 and iteration == 5:  # wedged here: heartbeats go on, then stop
                time.sleep(4 * beat_interval(HANG_TIMEOUT_S))
                os.kill(os.getpid(), signal.SIGSTOP)
            comm.all_reduce(torch.ones(4), group=groups.dp)
            time.sleep(0.01)
    except RuntimeError:  # a peer that ended first closed its connections: as pretrain does,
        dog.explain_failure(3 * dog.interval_s + 1)  # wait for the verdict (it ends us)
        raise
    return "never ended"


def test_a_stopped_rank_ends_every_rank_within_the_timeout_naming_it(capfd):
    start = time.monotonic()
    with pytest.raises(RankError) as err:
        run_on_ranks(_train_until_rank_2_stops, 4, timeout=60)
    elapsed = time.monotonic() - start
    report = str(err.value)
    # ranks 0, 1 and 3 end themselves; rank 2 stays stopped until the harness kills it
    assert report.count(f"died with exit code {EXIT_CODE}") >= 1, report
    assert elapsed < HANG_TIMEOUT_S + 3 * beat_interval(HANG_TIMEOUT_S) + 6, elapsed
    stderr = capfd.readouterr().err
    assert "rank 2 (pid " in stderr and "stopped answering" in stderr, stderr[-3000:]
    assert "iteration 5, train step, last collective all_reduce over dp group [0, 1, 2, 3]" \
        in stderr, stderr[-3000:]
    assert "noticed by rank 1" in stderr  # rank 1 watches rank 2
    assert stderr.count("stopped answering") == 1  # one report, not one per rank


# -- the whole program under torchrun -------------------------------------------------------

def _ranks_of(agent_pid):
    """{RANK: pid} of torchrun's worker processes: the agent's own children (their children,
    e.g. data-loader workers, inherit RANK too and must not be taken for the rank)."""
    found = {}
    with open(f"/proc/{agent_pid}/task/{agent_pid}/children") as f:
        children = [int(c) for c in f.read().split()]
    for child in children:
        try:
            with open(f"/proc/{child}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env and b"TORCHELASTIC_RUN_ID" in env:
            found[int(env[b"RANK"])] = child
    return found


def _run_and_signal_rank_1(tmp_path, signum):
    """torchrun a pp=2 job with --distributed-timeout-minutes 0.1 (6 s), send `signum` to rank
    1 (the last stage) once rank 0 logged iteration 3; returns (seconds to the job's end after
    the signal, torchrun's exit code, stderr, rank 1's pid). Two ranks: each torchrun'd rank
    costs ~5 s of CPU to start, and a stopped stage ends a pp x dp job the same way."""
    import subprocess
    import sys

    from test_e2e_training import PROGRAM

    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
             "--micro-batch-size 2 --global-batch-size 8 --train-iters 100000 --lr 1e-3 "
             "--tokenizer-type NullTokenizer --vocab-size 256 --mock-data --log-interval 1 "
             "--eval-iters 0 --no-progress --pipeline-model-parallel-size 2 "
             "--distributed-timeout-minutes 0.1").split()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           PROGRAM] + flags
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err_file, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"},
                                start_new_session=True)
        try:
            for line in proc.stdout:  # rank 0 logs every iteration
                if " iteration " in line and line.split(" iteration ")[1].strip().startswith("3/"):
                    break
            else:
                pytest.fail("the job ended before iteration 3:\n" + err_path.read_text()[-3000:])
            ranks = _ranks_of(proc.pid)
            assert sorted(ranks) == [0, 1], ranks
            os.kill(ranks[1], signum)
            signalled = time.monotonic()
            proc.wait(timeout=90)  # (a worker left behind may hold stdout open: no read)
            ended = time.monotonic() - signalled
        finally:
            try:  # torchrun and every worker it started share its process group
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    stderr = err_path.read_text()
    print(f"job ended {ended:.1f} s after signal {signum} to rank 1, exit code "
          f"{proc.returncode}\n{stderr[stderr.find('error'):][:800]}")
    return ended, proc.returncode, stderr, ranks[1]


@pytest.mark.e2e
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads workers from /proc")
def test_sigstop_of_one_rank_ends_the_torchrun_job_naming_it(tmp_path):
    """The issue's measurement: SIGSTOP one rank of a running pipeline job: the job must end
    (non-zero) within the timeout plus a bounded grace, naming the stopped rank."""
    ended, code, stderr, pid = _run_and_signal_rank_1(tmp_path, signal.SIGSTOP)
    assert code != 0
    # 6 s timeout + a beat or two (0.6 s each) to notice; the reporter SIGKILLs the stopped
    # worker (same host), so torchrun need not wait out its 30 s SIGTERM grace
    assert ended < 20, (ended, stderr[-3000:])
    assert f"rank 1 (pid {pid} on " in stderr and "stopped answering" in stderr, stderr[-3000:]
    report = stderr[stderr.index("gigatron: error: rank 1"):].splitlines()[0]
    assert "its last heartbeat said: iteration " in report, report


@pytest.mark.e2e
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads workers from /proc")
def test_kill_9_of_one_rank_ends_the_torchrun_job_within_seconds_naming_it(tmp_path):
    ended, code, stderr, pid = _run_and_signal_rank_1(tmp_path, signal.SIGKILL)
    assert code != 0
    assert ended < 10, (ended, stderr[-3000:])  # well inside the 6 s timeout's reach + grace
    assert f"exitcode  : -9 (pid: {pid})" in stderr, stderr[-3000:]  # torchrun names rank 1
