"""Horovod's negotiation for `gigatron.horovod`: operations are matched by name across the
ranks of a process set and checked before any data moves.

An operation (allreduce, allgather, ...) is first *submitted*: it waits, locally, under its
name (Horovod's automatic `<op>.noname.<n>` when none is given; a name already waiting raises
ValueError, as Horovod's duplicate-name check). When a rank needs a result (synchronize,
a blocking call, barrier, join) it runs *rounds*: one exchange of every member's waiting
names and their metadata (kind, dtype, shape, root, op, splits) over the set's group. An
operation every active member has submitted is then checked and launched, in the same order
on every rank; a mismatch (dtype, shape, root rank, op kind) becomes a RuntimeError on every
rank instead of garbage, an abort or a hang. A rank in `join()` keeps taking part in rounds:
it adds zeros to the others' allreduces, and other operations fail while a rank has joined.
Operations never complete on their own: Horovod's background thread is replaced by rounds at
the points where a rank waits, so `poll()` is False until someone waits.
"""
from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from gigatron.parallel import comm

Meta = Dict[str, Any]


@dataclass
class Launch:
    """What a starting operation knows of the others: every participant's metadata by set
    rank, and the set ranks that have joined (they contribute zeros)."""

    metas: Dict[int, Meta]
    joined: List[int]
    group: Any
    set_rank: int
    set_size: int
    global_ranks: List[int]


@dataclass
class Request:
    """One submitted operation on this rank."""

    kind: str
    meta: Meta  # exchanged and compared: dtype, shape, root, op, splits (picklable)
    start: Callable[[Launch], Callable[[], Any]]  # launches; gives what waits for the result
    name: str = ""
    finish: Optional[Callable[[], Any]] = None
    error: Optional[BaseException] = None
    works: List[Any] = field(default_factory=list)

    @property
    def launched(self) -> bool:
        return self.finish is not None or self.error is not None


def _shape_problem(kind: str, metas: Dict[int, Meta]) -> Optional[str]:
    shapes = {r: tuple(m["shape"]) for r, m in metas.items()}
    if kind in ("allgather", "alltoall"):
        ndims = {r: len(s) for r, s in shapes.items()}
        tails = {r: s[1:] for r, s in shapes.items()}
        if len(set(ndims.values())) > 1:
            return f"Mismatched {kind} tensor ranks (dimensions) per rank: {ndims}"
        if len(set(tails.values())) > 1:
            return (f"Mismatched {kind} tensor shapes beyond the first dimension per rank: "
                    f"{shapes}")
    elif len(set(shapes.values())) > 1:
        return f"Mismatched {kind} tensor shapes per rank: {shapes}"
    return None


def check(kind_by_rank: Dict[int, str], metas: Dict[int, Meta]) -> Optional[str]:
    """Why the participants' metadata for one name do not make one operation (None if they
    do): what Horovod's coordinator checks."""
    if len(set(kind_by_rank.values())) > 1:
        return f"Mismatched operations per rank: {kind_by_rank}"
    kind = next(iter(kind_by_rank.values()))
    for key, what in (("dtype", "data types"), ("root", "root ranks"), ("op", "reduce ops"),
                      ("device", "devices"), ("count", "numbers of tensors")):
        values = {r: m.get(key) for r, m in metas.items()}
        if len(set(map(repr, values.values()))) > 1:
            return f"Mismatched {kind} {what} per rank: {values}"
    if "shape" in next(iter(metas.values())):
        return _shape_problem(kind, metas)
    return None


class Controller:
    """The waiting operations and the rounds of one process set on this rank."""

    def __init__(self, group: Any, set_size: int, set_rank: int,
                 global_ranks: Sequence[int]) -> None:
        self.group, self.set_size, self.set_rank = group, set_size, set_rank
        self.global_ranks = list(global_ranks)
        self.pending: Dict[str, Request] = {}
        self._counters: Dict[str, int] = defaultdict(int)
        self.joined = False
        self._joined_ranks: List[int] = []  # in the order they joined
        self.all_joined = False
        self._last_submitted: Dict[int, List[str]] = {}

    def submit(self, request: Request, name: Optional[str]) -> Request:
        """Queue `request` under `name`; a name already waiting raises ValueError."""
        if name is None:
            name = f"{request.kind}.noname.{self._counters[request.kind]}"
            self._counters[request.kind] += 1
        if name in self.pending:
            raise ValueError(f"Requested to {request.kind} a tensor with the same name as "
                             f"another tensor that is currently being processed: {name!r}")
        request.name = name
        self.pending[name] = request
        if self.set_size == 1:
            self.run_round()  # alone: nothing to wait for
        return request

    def wait(self, request: Request) -> None:
        """Run rounds until `request` has been launched (or refused). Rounds run only while
        ranks wait, so a round where every active member waits and nothing matches can
        never progress: that raises on every active member instead of hanging."""
        while not request.launched:
            if not self.run_round() and not request.launched:
                self.pending.pop(request.name, None)
                raise RuntimeError(f"Stalled: every rank waits for an operation no other rank "
                                   f"has submitted (names or call order differ); submitted "
                                   f"per rank: {self._last_submitted}")

    def join(self) -> int:
        """Horovod's join: take part in rounds until every member has joined; the set rank
        (as a global rank) of the last one to join."""
        self.joined = True
        try:
            while not self.all_joined:
                self.run_round()
        finally:
            self.joined, self.all_joined = False, False
        last = self._joined_ranks[-1]
        self._joined_ranks = []
        return self.global_ranks[last]

    def _exchange(self, mine: Any) -> List[Any]:
        if self.set_size == 1:
            return [mine]
        data = torch.frombuffer(bytearray(pickle.dumps(mine)), dtype=torch.uint8)
        device = _control_device()
        lengths = torch.empty(self.set_size, dtype=torch.int64, device=device)
        comm.all_gather(lengths, torch.tensor([data.numel()], device=device), self.group)
        longest = int(lengths.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:data.numel()] = data.to(device)
        everyone = torch.empty(self.set_size * longest, dtype=torch.uint8, device=device)
        comm.all_gather(everyone, padded, self.group)
        rows = everyone.view(self.set_size, longest).cpu()
        return [pickle.loads(rows[r, :int(n)].numpy().tobytes())
                for r, n in enumerate(lengths.tolist())]

    def run_round(self) -> bool:
        """One negotiation: launch (or refuse) what every active member has submitted;
        whether anything was (or every member has joined)."""
        mine = (self.joined, [(n, r.kind, r.meta) for n, r in self.pending.items()])
        infos = self._exchange(mine)
        newly = [r for r, (j, _) in enumerate(infos) if j and r not in self._joined_ranks]
        self._joined_ranks += newly
        joined = [r for r, (j, _) in enumerate(infos) if j]
        active = [r for r, (j, _) in enumerate(infos) if not j]
        if not active:
            self.all_joined = True
            return True
        listed = {r: {n: (k, m) for n, k, m in infos[r][1]} for r in active}
        ready = [n for n, _, _ in infos[active[0]][1] if all(n in listed[r] for r in active)]
        self._last_submitted = {r: sorted(listed[r]) for r in active}
        for name in ready:
            self._catch_up(name)
            kinds = {r: listed[r][name][0] for r in active}
            metas = {r: listed[r][name][1] for r in active}
            problem = check(kinds, metas)
            kind = kinds[active[0]]
            if problem is None and joined and kind not in ("allreduce", "barrier"):
                problem = (f"{kind} {name!r} cannot run while ranks {joined} of the process "
                           f"set have joined (hvd.join): only allreduce can")
            launch = Launch(metas, joined, self.group, self.set_rank, self.set_size,
                            self.global_ranks)
            request = self.pending.pop(name, None)
            if request is None:  # this rank joined: add zeros to the others' allreduce
                if problem is None and kind == "allreduce":
                    _zeros_allreduce(metas[active[0]], launch)
                continue
            if problem is not None:
                request.error = RuntimeError(problem)
                continue
            try:
                request.finish = request.start(launch)
            except Exception as err:  # noqa: BLE001 - kept for synchronize() to raise
                request.error = err
        return bool(ready)

    def _catch_up(self, name: str) -> None:
        """An automatic name every active member submitted moves this rank's counter past
        it, so a rank that sat it out (joined) keeps naming like the others."""
        kind, sep, number = name.rpartition(".noname.")
        if sep and number.isdigit():
            self._counters[kind] = max(self._counters[kind], int(number) + 1)


def _control_device() -> torch.device:
    from gigatron.engine.horovod.basics import comm_device
    return comm_device()


# set by ops.py: starts an allreduce of zeros shaped as `meta` (a joined rank's share)
_zeros_allreduce: Callable[[Meta, Launch], None] = lambda meta, launch: None


def set_zeros_allreduce(fn: Callable[[Meta, Launch], None]) -> None:
    """Register how a joined rank adds zeros to an allreduce (ops.py owns the allreduce)."""
    global _zeros_allreduce
    _zeros_allreduce = fn


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as exchanged between ranks."""
    return str(dtype).replace("torch.", "")


def describe(tensor: torch.Tensor, **extra: Any) -> Meta:
    """The metadata of one tensor that ranks compare."""
    return {"dtype": dtype_name(tensor.dtype), "shape": tuple(tensor.shape),
            "device": tensor.device.type, **extra}
