"""A rank whose data loader stops delivering is named as such, and the job ends.

Issue 30, part 2: SIGSTOP of one rank's data-loader workers used to leave the job running
until the collectives timed out, and the report blamed a peer ("every peer still beats").
Now the data iterator marks each wait for a batch in `activity` with the workers' pids, and
the rank's own watchdog thread, once the wait passes --distributed-timeout-minutes, posts a
verdict naming the rank, the wait and the workers ("worker pids ... (stopped) not
answering"); every rank ends on it. With --num-workers 0 there are no workers: the training
process reads the samples itself, and the verdict says that its own read has not returned.
"""
import multiprocessing
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch

from gigatron.parallel.activity import WAITING_FOR_DATA, Activity, activity, waited_for
from gigatron.parallel.watchdog import EXIT_CODE, Watchdog, data_loader_stuck, process_state
from gigatron.training.run import pretrain
from multirank import RankError, run_on_ranks
from test_watchdog import DictStore


@pytest.fixture(scope="module", autouse=True)
def imported_before_forking():
    """The forked ranks inherit the program's modules and torch's lazily imported compiler
    (AdamW's constructor imports torch._dynamo: seconds in every fresh process)."""
    import gigatron.training.run.loop  # noqa: F401

    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def test_the_wait_for_a_batch_is_a_phase_with_its_clock_and_is_undone_after():
    a = Activity()
    a.at(4, "train step")
    with a.waiting(WAITING_FOR_DATA, [11, 12]):
        assert a.phase == WAITING_FOR_DATA and a.waiting_on == (11, 12)
        assert a.describe() == "iteration 4, waiting for its data loader for 0 s"
    assert (a.phase, a.waiting_on) == ("train step", ())


def test_the_verdict_names_the_rank_the_wait_and_each_worker_state():
    text = data_loader_stuck(2, 60.2, [os.getpid(), 2 ** 22 + 1], 7)
    assert text.startswith(f"rank 2 waits for its data loader for 60 s in iteration 7: worker "
                           f"pids {os.getpid()} (running), {2 ** 22 + 1} not answering. "), text
    assert "--num-workers 0" in data_loader_stuck(0, 5, [])


class _PhaseSeen(torch.utils.data.Dataset):
    """Four samples `make(i)`; records the reading process's phase at every read."""

    def __init__(self, make):
        self.make, self.seen = make, []

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.seen.append(activity.phase)
        return self.make(i)


def test_pretraining_and_engine_loaders_mark_their_reads_as_waits_for_data():
    from gigatron.data.samplers import build_pretraining_data_loader
    from gigatron.engine.deepspeed.data_loader import EngineDataLoader
    from gigatron.training.run.builders import _to_executor

    activity.at(1, "train step")
    engine = _PhaseSeen(lambda i: torch.tensor([i]))
    assert len(list(EngineDataLoader(engine, 2, rank=0, world_size=1))) == 2
    samples = _PhaseSeen(lambda i: {"tokens": np.zeros(2, dtype=np.int64)})
    pipeline = types.SimpleNamespace(needs_inputs=False, needs_labels=False)
    loader = build_pretraining_data_loader(samples, 0, 2, 0, 1)
    assert len(list(_to_executor(loader, torch.device("cpu"), pipeline))) == 2
    assert engine.seen == samples.seen == [WAITING_FOR_DATA] * 4
    assert activity.phase == "train step"


class _Blocking:
    """Two batches, then a read that never returns (a hung filesystem, say)."""

    def __init__(self):
        self.release = threading.Event()

    def __iter__(self):
        yield {"tokens": 0}
        yield {"tokens": 1}
        self.release.wait()


def test_a_read_that_never_returns_with_no_workers_is_named_by_the_ranks_own_watchdog():
    store, verdicts = DictStore(), []
    dog = Watchdog(store, 1, 2, 0.3, "p/", interval_s=0.02,
                   on_verdict=lambda message, reporter: verdicts.append((message, reporter)))
    source = _Blocking()
    batches = waited_for(source)
    activity.at(9, "train step")
    assert next(batches) == {"tokens": 0} and activity.phase == "train step"
    assert dog.check() is None  # a batch arrived: nothing to say
    reader = threading.Thread(target=lambda: list(batches), daemon=True)
    reader.start()
    try:
        time.sleep(0.1)
        assert dog.check() is None  # waiting, but not for longer than the timeout yet
        time.sleep(0.3)
        message = dog.check()
    finally:
        source.release.set()
        reader.join(5)
    assert message is not None and message.startswith(
        "rank 1 waits for its data loader for 0 s in iteration 9: no worker processes "
        "(--num-workers 0), and the training process's own read of the dataset has not "
        "returned"), message
    assert verdicts == [(message, True)]  # it reports itself
    assert activity.phase == "train step"


def test_a_peer_whose_collective_timed_out_names_the_rank_still_waiting_for_data():
    """The waiting rank names itself once its wait passes the timeout; a peer whose
    collective failed first waits for that, and if it does not come (a starved thread)
    posts it from the heartbeat; only the waiting rank, which owns the workers, ends them."""
    store, verdicts = DictStore(), []
    dogs = _watchdogs(store, 3, 1.0, verdicts)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        while process_state(worker.pid) != " (stopped)":
            time.sleep(0.01)
        for d in dogs:
            d._publish("running")
        dogs[1]._publish("done")  # (no verdict on rank 1, whose beats this test does not move)
        beat = json.loads(store.data["p/2"])
        beat.update(phase=WAITING_FOR_DATA, phase_s=0.1, waiting_on=[worker.pid], iteration=8)
        beating = _keep_beating(store, "p/2", beat)  # rank 2 lives: its beats move
        started = time.monotonic()
        # a short wait is any rank's next batch: no cause, but rank 2 may name itself soon
        assert "data loader" not in dogs[0].explain_failure(0.05) and not verdicts
        assert time.monotonic() - started > 0.9  # it gave rank 2 the time to do so
        beat["phase_s"] = 1.6  # past the timeout and two beats: its verdict is overdue
        assert dogs[0].explain_failure(0.05) == "a rank waiting for its data loader was named"
        beating.set()
        assert worker.poll() is None  # not rank 0's to end
        dogs[2].check()
        assert worker.wait(timeout=5) == -signal.SIGKILL
    finally:
        worker.kill()
        worker.wait()
    message = (f"rank 2 waits for its data loader for 2 s in iteration 8: worker pid "
               f"{worker.pid} (stopped) not answering. ")
    assert verdicts[0][:2] == (0, True) and verdicts[0][2].startswith(message), verdicts
    assert verdicts[1][:2] == (2, False)


def _keep_beating(store, key, beat):
    """A thread that republishes `beat` (as it changes) with a moving counter; set the
    returned event to stop it."""
    stop = threading.Event()

    def run():
        while not stop.wait(0.005):
            beat["beat"] += 1
            store.set(key, json.dumps(beat))

    threading.Thread(target=run, daemon=True).start()
    return stop


def _watchdogs(store, n, timeout, verdicts):
    return [Watchdog(store, r, n, timeout, "p/", interval_s=0.01,
                     on_verdict=lambda msg, reporter, r=r: verdicts.append((r, reporter, msg)))
            for r in range(n)]


# -- the issue's job: 4 ranks, tp2 pp2, rank 2's workers stopped ---------------------------

TIMEOUT_MINUTES = 0.05  # 3 s: the smallest the test can afford (the flag takes a float)
FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --mock-data --vocab-size 128 "
         "--log-interval 1 --eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 "
         "--train-iters 1000 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
         f"--distributed-timeout-minutes {TIMEOUT_MINUTES}").split()


def _train_until_rank_2_data_stalls(rank, world, workers, stalled_file):
    """Rank 2's third batch never comes: with workers, the worker making it stops itself
    (as `kill -STOP`); without, the training process's own read blocks for good."""
    from gigatron.data import samplers

    # a forked test rank is daemonic, and daemonic processes may not start the loader's
    # worker processes: this rank is a training process like torchrun's
    multiprocessing.current_process().daemon = False
    if rank == 2:
        collate, made = samplers.collate_samples, [0]

        def stall_on_the_third_batch(samples):
            made[0] += 1  # counted per process (each worker has its own copy)
            if made[0] == 3:
                with open(f"{stalled_file}.{os.getpid()}", "w") as f:
                    f.write(repr(time.time()))
                if workers:
                    os.kill(os.getpid(), signal.SIGSTOP)
                threading.Event().wait()  # a read that never returns
            return collate(samples)

        samplers.collate_samples = stall_on_the_third_batch
    return pretrain.main(FLAGS + ["--num-workers", str(workers)])


def _stalled_job(tmp_path, capfd, workers):
    """Run the job; (rank 2's verdict line, the pids of the processes that stalled)."""
    with pytest.raises(RankError) as err:
        run_on_ranks(_train_until_rank_2_data_stalls, 4, workers, str(tmp_path / "stalled"),
                     timeout=90)
    ended = time.time()
    report, stderr = str(err.value), capfd.readouterr().err
    assert f"died with exit code {EXIT_CODE}" in report, report
    # with workers, the one that owed the next batch stopped; the other one, if it has not
    # reached its own third batch yet, idles (it waits for the main process to take its
    # batches)
    stops = list(tmp_path.glob("stalled.*"))
    assert 1 <= len(stops) <= max(workers, 1), (stops, stderr[-3000:])
    stalled_at = min(float(p.read_text()) for p in stops)
    stalled = {int(p.name.split(".")[1]) for p in stops}
    timeout_s = 60 * TIMEOUT_MINUTES
    print(f"--num-workers {workers}: the job ended {ended - stalled_at:.1f} s after rank 2's "
          f"data stalled (timeout {timeout_s:.0f} s)")
    assert ended - stalled_at < timeout_s + 5, ended - stalled_at
    assert stderr.count("waits for its data loader for") == 1  # one report, not one per rank
    assert "every peer still beats" not in stderr and "stopped answering" not in stderr
    line = next(line for line in stderr.splitlines() if "waits for its data loader" in line)
    # the rank names itself once the wait passes the timeout, or the first peer whose
    # collective timed out names it from its heartbeat (a fraction of a second older)
    waited = re.match(r"gigatron: error: rank 2 waits for its data loader for (\d+) s in "
                      r"iteration \d+: ", line)
    assert waited is not None and 1 <= int(waited[1]) <= timeout_s + 5, line
    return line, stalled


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads worker states from /proc")
def test_stopped_data_loader_workers_of_rank_2_are_named_and_end_the_job(tmp_path, capfd):
    line, stopped = _stalled_job(tmp_path, capfd, workers=2)
    named = re.search(r"worker pids (\d+) \((\w+)\), (\d+) \((\w+)\) not answering", line)
    assert named is not None, line
    states = {int(named[1]): named[2], int(named[3]): named[4]}
    assert {pid for pid, state in states.items() if state == "stopped"} == stopped, line
    for pid in states:  # rank 2 ended its workers: nothing is left behind
        assert not os.path.exists(f"/proc/{pid}") or \
            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX", pid


def test_with_no_workers_a_read_of_rank_2_that_never_returns_is_named(tmp_path, capfd):
    line, _ = _stalled_job(tmp_path, capfd, workers=0)
    assert line.endswith(": no worker processes (--num-workers 0), and the training "
                         "process's own read of the dataset has not returned. Every rank is "
                         "ending (--distributed-timeout-minutes sets the wait)"), line
