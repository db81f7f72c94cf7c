"""Non-persistent checkpoints that each rank keeps itself: --non-persistent-ckpt-type local
(node-local storage) and in_memory (host memory: a tmpfs such as /dev/shm, and a copy of
every rank's state in the memory of a peer rank on the next node).

    DIR/gigatron-in_memory-<job>/held_by_00003/rank_00003_iter_0000008.pt    rank 3's state
    DIR/gigatron-in_memory-<job>/held_by_00003/rank_00002_iter_0000008.pt    rank 2's copy
    DIR/gigatron-in_memory-<job>/held_by_00003/rank_00002_iter_0000008.json  its iteration,
                                                    owner, layout, crc32 and size

<job> is a hash of the --save folder when saving and of --load when loading: a restart runs
the same command, so it finds the files of its own job and of no other.

Save (collective; the state is never gathered): each rank serialises its state once (local:
straight into the file) and writes it under a temporary name, renamed into place after its
sidecar is written (a file counts only once renamed: a crash never leaves a half-written
newest); in_memory also sends the bytes to its peer, which writes them the same way. All ranks report success (one
all-gather of a flag) and only then delete their older files, so a crash during a save
leaves every rank's previous checkpoint.

Load (collective): each rank lists the files it can see; from the gathered lists every rank
computes the same choice, the newest iteration newer than the persistent checkpoint of
which every rank's state is held somewhere in this run's layout. A rank whose own file is
gone (its node was lost) receives the copy from the rank that holds it. Every file's CRC32
is checked; anything missing or damaged means: resume from the persistent checkpoint, with
one line saying why. (A CRC32, not sha256 as persistent checkpoints: these guard against
crashes, not tampering, and must be cheap; computed once, by the rank that owns the state.)
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import socket
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, BinaryIO, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist

from gigatron.training.checkpoint.folders import atomic_write_text
from gigatron.training.checkpoint.integrity import job_gather, raise_if_any_failed
from gigatron.training.checkpoint.torch_dist.save_load import all_objects

KINDS = ("local", "in_memory")
_NAME = re.compile(r"rank_(\d+)_iter_(\d+)\.pt$")


def job_folder(base: str, kind: str, root: str) -> str:
    """The folder of one job's (named by its --save / --load folder) rank copies."""
    tag = hashlib.sha1(os.path.abspath(root).encode()).hexdigest()[:12]
    return os.path.join(base, f"gigatron-{kind}-{tag}")


def copy_path(job: str, holder: int, owner: int, iteration: int) -> str:
    """Where rank `holder` keeps rank `owner`'s state of `iteration`."""
    return os.path.join(job, f"held_by_{holder:05d}", f"rank_{owner:05d}_iter_{iteration:07d}.pt")


def _sidecar(path: str) -> str:
    return path[:-len(".pt")] + ".json"


def peer_ranks(hosts: List[str]) -> List[int]:
    """Each rank's peer, which keeps a copy of its state: the rank of the same local index on
    the next node (cyclically), so that losing one node loses no state; on one node, the
    next rank. `hosts`: every rank's host name, in rank order."""
    nodes: Dict[str, List[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    order = list(nodes.values())
    if len(order) == 1:
        return [(rank + 1) % len(hosts) for rank in range(len(hosts))]
    peers = [0] * len(hosts)
    for i, ranks in enumerate(order):
        following = order[(i + 1) % len(order)]
        for j, rank in enumerate(ranks):
            peers[rank] = following[j % len(following)]
    return peers


class _CrcWriter(io.RawIOBase):
    """A write-only file object that takes the CRC32 of the bytes on their way to `file`."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__()
        self._file, self.crc = file, 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:  # type: ignore[override]
        view = memoryview(data).cast("B")
        self._file.write(view)
        self.crc = zlib.crc32(view, self.crc)
        return view.nbytes


def _write(path: str, meta: Dict[str, Any], state: Optional[Dict[str, Any]] = None,
           data: Optional[memoryview] = None, crc: int = 0) -> None:
    """Write `state` (serialised straight into the file, its CRC32 taken on the way) or
    `data` (of CRC32 `crc`), then its sidecar, so that the file counts only once complete.
    No fsync: these checkpoints outlive a process, not the node's kernel (a file torn by a
    kernel crash fails its CRC)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    part = f"{path}.part"
    with open(part, "wb") as f:
        if state is not None:
            writer = _CrcWriter(f)
            torch.save(state, cast(BinaryIO, writer))
            crc = writer.crc
        else:
            assert data is not None
            f.write(data)
        size = f.tell()
    atomic_write_text(_sidecar(path), json.dumps({**meta, "crc32": crc, "bytes": size}))
    os.replace(part, path)


def remove_copies(job: str, holder: int, keep: Optional[int] = None,
                  up_to: Optional[int] = None) -> None:
    """Delete rank `holder`'s files but those of iteration `keep` (or those of iterations
    up to `up_to`); an emptied folder goes too."""
    held = os.path.dirname(copy_path(job, holder, 0, 0))
    for name in sorted(os.listdir(held)) if os.path.isdir(held) else []:
        match = _NAME.match(name.replace(".part", "").replace(".json", ".pt"))
        if match is None:
            continue
        iteration = int(match.group(2))
        if (keep is not None and iteration != keep) or \
                (up_to is not None and iteration <= up_to) or name.endswith(".part"):
            try:
                os.remove(os.path.join(held, name))
            except FileNotFoundError:
                pass
    for folder in (held, job):
        try:
            os.rmdir(folder)
        except OSError:  # not empty (or gone)
            pass


class RankCopies:
    """Saves one kind of rank copies (its gloo group and peers are made at the first save)."""

    def __init__(self, kind: str, timeout_minutes: float) -> None:
        self.kind, self.timeout = kind, timedelta(minutes=timeout_minutes)
        self._group: Any = None
        self._peers: Optional[List[int]] = None

    def _peer_setup(self, world: int) -> Tuple[Any, List[int]]:
        """Collective at the first in_memory save: the peers (from every rank's host name)
        and a gloo group for the copies (host bytes, whatever backend trains)."""
        if self._peers is None:
            self._peers = peer_ranks(all_objects(socket.gethostname(), None))
            if world > 1:
                self._group = dist.new_group(backend="gloo", timeout=self.timeout)
        return self._group, self._peers

    def save(self, job: str, state: Dict[str, Any], meta: Dict[str, Any], rank: int,
             world: int, device: torch.device) -> str:
        """Collective: keep this rank's `state` of iteration meta["iteration"] (and, for
        in_memory, its peer's copy); a failure on any rank raises on every rank and leaves
        the previous checkpoint."""
        iteration = int(meta["iteration"])
        failure: Optional[BaseException] = None
        path = copy_path(job, rank, rank, iteration)
        if self.kind == "local":  # serialised straight into the file
            try:
                _write(path, {**meta, "owner": rank}, state=state)
            except OSError as err:
                failure = err
        else:  # serialised once: the bytes go to the file and to the peer
            buffer = io.BytesIO()
            torch.save(state, buffer)
            data = buffer.getbuffer()
            received = {rank: (data, zlib.crc32(data))}
            if world > 1:
                group, peers = self._peer_setup(world)
                received.update(_send_to_peer(data, received[rank][1], peers, rank, group))
            for owner, (payload, crc) in received.items():
                try:
                    _write(copy_path(job, rank, owner, iteration), {**meta, "owner": owner},
                           data=payload, crc=crc)
                except OSError as err:
                    failure = failure or err
        if failure is not None:
            failure = ValueError(f"could not keep the {self.kind} non-persistent checkpoint of "
                                 f"iteration {iteration} in {job}: {failure}")
        raise_if_any_failed(job_gather(device), failure, lambda ranks: (
            f"ranks {', '.join(map(str, ranks))} could not keep their {self.kind} "
            f"non-persistent checkpoint of iteration {iteration} (their error lines say why): "
            f"this rank stops too"))
        remove_copies(job, rank, keep=iteration)
        return job


def _send_to_peer(data: memoryview, crc: int, peers: List[int], rank: int, group: Any
                  ) -> Dict[int, Tuple[memoryview, int]]:
    """Send `data` (and its `crc`) to this rank's peer; returns the bytes and crc of each
    rank whose peer this is."""
    sources = [q for q, p in enumerate(peers) if p == rank and q != rank]
    heads = {q: torch.zeros(2, dtype=torch.int64) for q in sources}
    _wait([dist.isend(torch.tensor([len(data), crc]), peers[rank], group)] +
          [dist.irecv(t, q, group) for q, t in heads.items()])
    received = {q: torch.empty(int(t[0]), dtype=torch.uint8) for q, t in heads.items()}
    _wait([dist.isend(torch.frombuffer(data, dtype=torch.uint8), peers[rank], group)] +
          [dist.irecv(t, q, group) for q, t in received.items()])
    return {q: (t.numpy().data, int(heads[q][1])) for q, t in received.items()}


def _wait(works: List[Any]) -> None:
    for work in works:
        work.wait()


@dataclass(frozen=True)
class Copy:
    """One kept file as a rank sees it (gathered at load)."""

    owner: int
    iteration: int
    path: str
    meta: Dict[str, Any]


def inventory(job: str) -> List[Copy]:
    """Every complete file under `job` that this rank can read."""
    found = []
    for held in sorted(os.listdir(job)) if os.path.isdir(job) else []:
        folder = os.path.join(job, held)
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            match = _NAME.match(name)
            if match is None:
                continue
            path = os.path.join(folder, name)
            try:
                with open(_sidecar(path), encoding="utf-8") as f:
                    meta = json.load(f)
            except (OSError, ValueError):
                continue
            found.append(Copy(int(match.group(1)), int(match.group(2)), path, meta))
    return found


@dataclass(frozen=True)
class Plan:
    """What a load reads: for each rank (owner), the rank that can read its file, and it."""

    iteration: int
    readers: Dict[int, Tuple[int, Copy]]


def _sizes(layout: Dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in layout.items())


def choose(seen: List[List[Copy]], world: int, layout: Dict[str, Any], newer_than: int,
           kind: str) -> Tuple[Optional[Plan], Optional[str]]:
    """The newest iteration above `newer_than` of which every rank's state is readable by
    some rank (its own file first) in `layout`; else None and the line saying why (None:
    there is nothing newer). `seen[r]`: the files rank r can read. Pure: every rank computes
    the same answer from the same lists."""
    newer = sorted({c.iteration for copies in seen for c in copies if c.iteration > newer_than},
                   reverse=True)
    if not newer:
        return None, None
    head = f"the {kind} non-persistent checkpoint of iteration {newer[0]}"
    saved = next(c.meta.get("layout") for copies in seen for c in copies
                 if c.iteration == newer[0])
    if saved != layout:
        return None, (f"{head} was saved with {_sizes(saved or {})} but this run has "
                      f"{_sizes(layout)}: it loads only into the layout that saved it; "
                      f"resuming from the persistent checkpoint instead")
    lost: List[int] = []
    for iteration in newer:
        readers: Dict[int, Tuple[int, Copy]] = {}
        for rank, copies in enumerate(seen):
            for c in copies:
                if c.iteration == iteration and c.meta.get("layout") == layout and \
                        (c.owner not in readers or rank == c.owner):
                    readers[c.owner] = (rank, c)
        if set(readers) >= set(range(world)):
            return Plan(iteration, readers), None
        if iteration == newer[0]:
            lost = sorted(set(range(world)) - set(readers))
    return None, (f"{head} is incomplete: no copy of the state of rank"
                  f"{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} is left; "
                  f"resuming from the persistent checkpoint instead")


def load(job: str, kind: str, rank: int, world: int, layout: Dict[str, Any], newer_than: int,
         timeout_minutes: float) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """Collective: this rank's state of the newest usable iteration above `newer_than`
    (None: resume from the persistent checkpoint) and a line saying why not, if any."""
    plan, note = choose(all_objects(inventory(job), None), world, layout, newer_than, kind)
    if plan is None:
        return None, note
    data = _fetch(plan, rank, timedelta(minutes=timeout_minutes))
    reader, copy = plan.readers[rank]
    # its own file is checked as it streams past; a peer's arrives as bytes
    crc, failure = _file_crc(copy.path) if data is None else (zlib.crc32(data), None)
    if failure is None and crc != copy.meta.get("crc32"):
        failure = f"{copy.path} (read by rank {reader}) does not match its recorded crc32"
    failures = [f for f in all_objects(failure, None) if f is not None]
    if failures:
        return None, (f"the {kind} non-persistent checkpoint of iteration {plan.iteration} "
                      f"cannot be used: {failures[0]}; resuming from the persistent "
                      f"checkpoint instead")
    # a file this rank reads is mapped, not read into memory: an offloaded optimizer's
    # shard (12 B/param) would otherwise sit beside the live one, twice (bytes, tensors)
    state = torch.load(copy.path if data is None else io.BytesIO(data), map_location="cpu",
                       weights_only=False, mmap=data is None)
    state.update({"_folder": f"{job} ({kind} non-persistent)", "_format": "torch",
                  "_zero_stage": layout.get("zero_stage")})
    return state, None


def _fetch(plan: Plan, rank: int, timeout: timedelta) -> Optional[memoryview]:
    """Collective: this rank's file received from the rank that can read it (None: this
    rank reads it itself)."""
    moves = [(owner, reader, c) for owner, (reader, c) in sorted(plan.readers.items())
             if reader != owner]
    group = dist.new_group(backend="gloo", timeout=timeout) if moves else None
    reader, _ = plan.readers[rank]
    own = bytearray()
    works, sent = [], []
    for owner, holder, c in moves:
        if holder == rank:
            payload, _ = _read(c)  # a failed read sends zeros: the owner's checksum fails
            sent.append(payload)
            works.append(dist.isend(torch.frombuffer(payload, dtype=torch.uint8), owner, group))
        if owner == rank:
            own = bytearray(int(c.meta["bytes"]))
            works.append(dist.irecv(torch.frombuffer(own, dtype=torch.uint8), holder, group))
    _wait(works)
    return None if reader == rank else memoryview(own)


def _file_crc(path: str) -> Tuple[int, Optional[str]]:
    """The CRC32 of a file read block by block (and the reason when it cannot be read)."""
    crc = 0
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                crc = zlib.crc32(block, crc)
    except OSError as err:
        return 0, f"{path} cannot be read ({err})"
    return crc, None


def _read(copy: Copy) -> Tuple[bytearray, Optional[str]]:
    """The file's bytes (zeros of the recorded size and the reason when it cannot be read)."""
    try:
        with open(copy.path, "rb") as f:
            return bytearray(f.read()), None
    except OSError as err:
        return bytearray(int(copy.meta["bytes"])), f"{copy.path} cannot be read ({err})"
