"""Name the rank that stopped answering: heartbeats through the launcher's rendezvous store.

A rank that hangs (SIGSTOP, a deadlock, a wedged device) leaves its peers blocked in a
collective; the collective's timeout then fails on whichever peer noticed first, naming that
peer, not the rank that stopped. So every rank runs a daemon thread that, every `interval`
seconds, publishes a heartbeat to the job's store (the TCPStore at MASTER_ADDR:MASTER_PORT
that torchrun's agent, or rank 0, hosts): a beat counter, its host and pid, and what it is
doing (iteration, phase, last collective, from `activity`). A stopped or dead process stops
beating; a live one keeps beating whatever its main thread does.

Each rank watches one peer (the next rank, so the job reads N keys per interval, not N^2).
A peer whose beats have not moved for `timeout` seconds is hung: the watcher posts a verdict
naming it (and SIGKILLs it when it runs on the same host: a stopped process ignores the
launcher's SIGTERM), and every rank's thread, reading the verdict, ends its process non-zero
(only the watcher prints the verdict), so the launcher ends the job. Ages are measured on
the watcher's own monotonic clock, so clock skew between hosts does not matter. A rank that
finishes (or fails with an error of its own) says so in its last beat and is never called
hung.

A rank whose data loader has not delivered a batch for `timeout` seconds is named by its own
watchdog thread (its process still runs, only its worker processes, or its own read with
--num-workers 0, do not answer): the iterator marks the wait in `activity` with the workers'
pids, the verdict names them and their state, and the rank SIGKILLs them (its children: a
stopped one would outlive the job). Its peers, blocked in a collective that waits for it,
would otherwise time out at the same moment and blame whichever peer noticed first.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

from gigatron.parallel.activity import WAITING_FOR_DATA, activity

VERDICT = "verdict"
EXIT_CODE = 3  # distinct from the 1 of an exception and the 2 of a bad flag


@dataclass
class Hung:
    """The verdict on a peer that stopped beating."""

    rank: int
    silent_s: float
    beat: Dict[str, Any]  # its last heartbeat (empty if none ever arrived)
    noticed_by: int
    noticer_doing: str = ""

    def message(self) -> str:
        b = self.beat
        where = f" (pid {b['pid']} on {b['host']})" if b else ""
        doing = (f"; its last heartbeat said: {b['doing']}" if b.get("doing")
                 else "; it never sent a heartbeat")
        noticer = f", itself at {self.noticer_doing}" if self.noticer_doing else ""
        return (f"rank {self.rank}{where} stopped answering: no heartbeat for "
                f"{self.silent_s:.0f} s (stopped, dead or frozen){doing}. Every rank is ending "
                f"(noticed by rank {self.noticed_by}{noticer}; --distributed-timeout-minutes "
                f"sets the wait)")


def data_loader_stuck(rank: int, waited_s: float, pids: Sequence[int],
                      iteration: Optional[int] = None, local: bool = True) -> str:
    """The verdict on a rank that has waited `waited_s` for a batch from its data loader;
    the workers' states are read where they run on this host (`local`)."""
    if pids:
        states = ", ".join(f"{pid}{process_state(pid) if local else ''}" for pid in pids)
        cause = f"worker pid{'s' if len(pids) > 1 else ''} {states} not answering"
    else:
        cause = ("no worker processes (--num-workers 0), and the training process's own read "
                 "of the dataset has not returned")
    at = "" if iteration is None else f" in iteration {iteration}"
    return (f"rank {rank} waits for its data loader for {waited_s:.0f} s{at}: {cause}. Every "
            f"rank is ending (--distributed-timeout-minutes sets the wait)")


def process_state(pid: int) -> str:
    """' (stopped)', ' (sleeping)', ... from /proc; '' where it cannot be read."""
    names = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O", "T": "stopped",
             "t": "stopped", "Z": "exited", "X": "exited"}
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return f" ({names.get(state, state)})"


def beat_interval(timeout_s: float) -> float:
    """Heartbeat period: a tenth of the timeout, between 0.1 s and 5 s."""
    return min(5.0, max(0.1, timeout_s / 10))


def watched_peer(rank: int, world_size: int) -> int:
    """The one peer `rank` watches: the next rank around the ring."""
    return (rank + 1) % world_size


def key_prefix(env: Mapping[str, str]) -> str:
    """Keys of this attempt (torchrun restarts reuse the agent's store: a verdict of a
    previous attempt must not end the next one)."""
    return (f"gigatron/watchdog/{env.get('TORCHELASTIC_RUN_ID', '')}/"
            f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/")


class Watchdog:
    """Publishes this rank's heartbeat, watches one peer, and ends the rank on a verdict."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout_s: float,
                 prefix: str = "", interval_s: Optional[float] = None,
                 on_verdict: Optional[Callable[[str, bool], None]] = None,
                 kill_hung: bool = False) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.prefix = timeout_s, prefix
        self.interval_s = interval_s or beat_interval(timeout_s)
        self.peer = watched_peer(rank, world_size)
        self.on_verdict = on_verdict or _end_process
        # SIGKILL a hung rank on this host when reporting it: a stopped process ignores the
        # launcher's SIGTERM (torchrun waits 30 s before SIGKILL; srun may wait forever)
        self.kill_hung = kill_hung
        self._beats = 0
        self._peer_seen: Optional[Dict[str, Any]] = None
        self._peer_moved = time.monotonic()
        self._store_down_since: Optional[float] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gigatron-watchdog",
                                        daemon=True)
        self._identity: Dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}

    def start(self) -> "Watchdog":
        self._publish("running")
        self._thread.start()
        return self

    def stop(self, status: str = "done") -> None:
        """Last beat (`done`, or `failed: ...`): watchers never call this rank hung."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2 * self.interval_s + 1)
        try:
            self._publish(status)
        except Exception:  # the store may be gone at shutdown; nothing to tell then
            pass

    # -- one round of the thread ------------------------------------------------------------
    def _run(self) -> None:
        """Beat every interval, and sooner (a fifth of it) when the iteration moved, so a
        hung rank's last heartbeat names the iteration it stopped in."""
        tick, last, sent = self.interval_s / 5, time.monotonic(), activity.iteration
        while not self._stop.wait(tick):
            now = time.monotonic()
            if now - last < self.interval_s and activity.iteration == sent:
                continue
            last, sent = now, activity.iteration
            try:
                self._publish("running")
                self._store_down_since = None
                self.check()
            except Exception as err:  # the store stopped answering: its host is hung or gone
                self._store_failed(err)

    def _publish(self, status: str) -> None:
        self._beats += 1
        beat = {"beat": self._beats, "status": status, "doing": activity.describe(),
                "iteration": activity.iteration, "phase": activity.phase,
                "phase_s": round(activity.phase_seconds(), 1),
                "waiting_on": list(activity.waiting_on),
                **self._identity}
        self.store.set(self._key(str(self.rank)), json.dumps(beat))

    def check(self) -> Optional[str]:
        """Read the verdict and the watched peer; act on a verdict. Returns it (tests)."""
        verdict = self._get(VERDICT)
        if verdict is None:
            found = self._judge_own_data_wait() or self._judge_peer()
            if found is not None:
                verdict = self._post(found)
        if verdict is None:
            return None
        decided = json.loads(verdict)
        if decided["by"] == self.rank:
            # say it first: once the hung rank dies, the agent stops this one within moments
            _announce(decided["message"])
            self._kill(decided.get("pid"), decided.get("host"))
        if decided.get("workers_of") == self.rank:  # a stopped worker would outlive the job
            for worker in decided["workers"]:
                _kill_quietly(worker)
        if self.rank == 0:  # without torchrun's agent rank 0 hosts the store: let the others
            time.sleep(2 * self.interval_s)  # read the verdict before it goes
        self.on_verdict(decided["message"], decided["by"] == self.rank)
        return decided["message"]

    def _post(self, verdict: Dict[str, Any]) -> str:
        """Post `verdict` unless one exists (the first verdict stands); returns the one that
        stands."""
        return _text(self.store.compare_set(self._key(VERDICT), "", json.dumps(verdict)))

    def _kill(self, pid: Optional[int], host: Optional[str]) -> None:
        if self.kill_hung and pid and host == self._identity["host"]:
            _kill_quietly(pid)

    def _judge_own_data_wait(self) -> Optional[Dict[str, Any]]:
        """This rank's verdict on itself when its data loader kept it waiting too long."""
        waited = activity.phase_seconds()
        if activity.phase != WAITING_FOR_DATA or waited < self.timeout_s:
            return None
        return self._data_wait_verdict(self.rank, waited, activity.waiting_on,
                                       activity.iteration, self._identity["host"])

    def _data_wait_verdict(self, rank: int, waited: float, pids: Sequence[int],
                           iteration: Optional[int], host: Optional[str]) -> Dict[str, Any]:
        local = host == self._identity["host"]
        return {"message": data_loader_stuck(rank, waited, pids, iteration, local),
                "by": self.rank, "workers": list(pids), "workers_of": rank}

    def _judge_peer(self) -> Optional[Dict[str, Any]]:
        hung = self._hung_peer()
        if hung is None:
            return None
        return {"message": hung.message(), "by": self.rank, "pid": hung.beat.get("pid"),
                "host": hung.beat.get("host")}

    def _hung_peer(self) -> Optional[Hung]:
        if self.world_size < 2:
            return None
        now = time.monotonic()
        raw = self._get(str(self.peer))
        beat = json.loads(raw) if raw else {}
        if beat and beat.get("status") != "running":
            return None  # finished, or failed with its own error (it reports that itself)
        if beat != (self._peer_seen or {}):
            self._peer_seen, self._peer_moved = beat, now
            return None
        silent = now - self._peer_moved
        if silent < self.timeout_s:
            return None
        return Hung(self.peer, silent, beat, self.rank, activity.describe())

    def _store_failed(self, err: Exception) -> None:
        """The store is unreachable: with no agent store it lives in rank 0's process."""
        if self._store_down_since is None:
            self._store_down_since = time.monotonic()
        if time.monotonic() - self._store_down_since >= self.timeout_s:
            self.on_verdict(f"the rendezvous store (hosted by rank 0 unless torchrun's agent "
                            f"hosts it) stopped answering for {self.timeout_s:.0f} s: rank 0 "
                            f"is stopped, dead or frozen ({err})", True)

    def explain_failure(self, wait_s: float) -> str:
        """After a collective failed on this rank: wait up to `wait_s` (at least two beats)
        for a verdict on a hung rank (acting on it ends this process), longer for a peer
        that waits for its data loader; else name the peers that stopped beating meanwhile
        (exited or killed) or that failed themselves."""
        try:
            before = self._all_beats()
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.check() is not None:
                    return "a hung rank was named"
                time.sleep(self.interval_s)
            after = self._all_beats()
            live = set(after) - set(silent_peers(before, after, self.rank))
            if self._await_data_verdict(after, live) or \
                    self._name_data_wait(self._all_beats(), live):
                return "a rank waiting for its data loader was named"
        except Exception as err:
            return (f"the rendezvous store is unreachable too ({err}): without torchrun's "
                    f"agent rank 0 hosts it, so rank 0 has probably exited")
        for rank in silent_peers(before, after, self.rank):  # stopped ones hold the job up
            self._kill(after[rank].get("pid"), after[rank].get("host"))
        return describe_peers(before, after, self.rank)

    def _await_data_verdict(self, beats: Dict[int, Dict[str, Any]], live: Set[int]) -> bool:
        """A (`live`: still beating) peer waiting for its data loader names itself once its
        wait passes the timeout (this rank's collective may have started before that wait and
        timed out first): give it that long and two beats, while it still waits."""
        deadline = time.monotonic() + self.timeout_s + 2 * self.interval_s
        while time.monotonic() < deadline:
            waits = [b["phase_s"] for r, b in beats.items() if r != self.rank and r in live
                     and b.get("status") == "running" and b.get("phase") == WAITING_FOR_DATA]
            if not waits or max(waits) > self.timeout_s + 2 * self.interval_s:
                return False  # none waits, or its own verdict is overdue: a starved thread
            if self.check() is not None:
                return True
            time.sleep(self.interval_s)
            beats = self._all_beats()
        return False

    def _name_data_wait(self, beats: Dict[int, Dict[str, Any]], live: Set[int]) -> bool:
        """A peer that has waited for its data loader for most of the timeout when this
        rank's collective failed is the cause, even if its own verdict has not come yet (a
        starved thread, a later start): post it on its behalf and act on it. (A short wait
        is any rank's ordinary next batch, and says nothing.)"""
        for rank, beat in sorted(beats.items()):
            if rank != self.rank and rank in live and beat.get("status") == "running" and \
                    beat.get("phase") == WAITING_FOR_DATA and \
                    beat["phase_s"] >= self.timeout_s / 2:
                self._post(self._data_wait_verdict(rank, beat["phase_s"], beat["waiting_on"],
                                                   beat.get("iteration"), beat.get("host")))
                return self.check() is not None
        return False

    def _all_beats(self) -> Dict[int, Dict[str, Any]]:
        beats = {}
        for rank in range(self.world_size):
            raw = self._get(str(rank))
            beats[rank] = json.loads(raw) if raw else {}
        return beats

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _get(self, name: str) -> Optional[str]:
        key = self._key(name)
        if not self.store.check([key]):
            return None
        return _text(self.store.get(key))


def silent_peers(before: Dict[int, Dict[str, Any]], after: Dict[int, Dict[str, Any]],
                 me: int) -> List[int]:
    """Peers still 'running' whose beat did not move between the two reads."""
    return [rank for rank in sorted(after) if rank != me and after[rank]
            and after[rank].get("status") == "running"
            and after[rank].get("beat") == before.get(rank, {}).get("beat")]


def describe_peers(before: Dict[int, Dict[str, Any]], after: Dict[int, Dict[str, Any]],
                   me: int) -> str:
    """Which peers went silent (same beat in both reads) or failed, from two reads of every
    rank's heartbeat taken a few beats apart."""
    lines = []
    silent = silent_peers(before, after, me)
    for rank in sorted(after):
        beat = after[rank]
        if rank == me or not beat:
            continue
        if rank in silent:
            lines.append(f"rank {rank} (pid {beat['pid']} on {beat['host']}) stopped beating: "
                         f"it exited or was killed without a word; its last heartbeat said: "
                         f"{beat.get('doing')}")
        elif str(beat.get("status", "")).startswith("failed"):
            lines.append(f"rank {rank} failed with its own error (see its output)")
    return "; ".join(lines) or ("every peer still beats: a peer's connection failed (see "
                                "the first error in the job's output)")


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # gone already, or not ours to end


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_announced: Set[str] = set()


def _announce(message: str) -> None:
    """Print the verdict (once) and leave it as this rank's error record for the launcher."""
    if message in _announced:
        return
    _announced.add(message)
    print(f"gigatron: error: {message}", file=sys.stderr, flush=True)
    from gigatron.parallel.launcher.worker import record_verdict

    record_verdict(message)


def _end_process(message: str, reporter: bool) -> None:
    """End this rank now: its main thread may be blocked inside a collective for good."""
    if reporter:
        _announce(message)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(EXIT_CODE)


def is_peer_failure(err: BaseException) -> bool:
    """A collective that failed because of another rank (timeout, closed connection)."""
    import torch.distributed as dist

    text = str(err)
    return isinstance(err, getattr(dist, "DistError", ())) or any(
        word in text for word in ("gloo", "NCCL", "Timed out", "Connection closed", "timeout"))


def start_watchdog(rank: int, world_size: int, master_addr: str, master_port: int,
                   timeout_s: float, env: Optional[Mapping[str, str]] = None
                   ) -> Optional[Watchdog]:
    """Start this rank's watchdog on a client of the job's store (None for one rank)."""
    import torch.distributed as dist

    if world_size < 2:
        return None
    env = os.environ if env is None else env
    interval = beat_interval(timeout_s)
    store = dist.TCPStore(master_addr, master_port, is_master=False, wait_for_workers=False,
                          timeout=timedelta(seconds=max(2 * interval, 1.0)))
    return Watchdog(store, rank, world_size, timeout_s, key_prefix(env), interval,
                    kill_hung=True).start()
