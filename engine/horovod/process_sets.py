"""Horovod's process sets for `gigatron.horovod`: collectives over a subset of the ranks.

A process set is a torch.distributed subgroup (the global set is the default group), with
its own negotiation (`controller.Controller`), so operations in different sets never wait
for each other. As in Horovod, `hvd.add_process_set` and `hvd.remove_process_set` are called
by every rank (torch creates a group collectively), members or not; `root_rank` of a
broadcast over a set is a global rank.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

import torch.distributed as dist

from gigatron.engine.horovod import basics


class ProcessSet:
    """Horovod's process set: the ranks of a sub-communicator, registered by
    `hvd.add_process_set` (or `hvd.init(process_sets=[...])`)."""

    def __init__(self, ranks: Sequence[int]) -> None:
        if isinstance(ranks, ProcessSet) or not all(isinstance(r, int) for r in ranks):
            raise ValueError(f"ProcessSet takes a list of global ranks, got {ranks!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"ProcessSet ranks must be unique, got {list(ranks)}")
        self.ranks: Optional[List[int]] = sorted(ranks)
        self.process_set_id: Optional[int] = None
        self.group: Any = None  # the torch group; None with the default group
        self._controller: Any = None

    def _invalidate(self) -> None:
        self.process_set_id, self.group, self._controller = None, None, None

    def size(self) -> Optional[int]:
        """Ranks in the set (None until it is registered)."""
        if self.process_set_id is None:
            return None
        return len(self.ranks) if self.ranks is not None else basics.size()

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None if not registered or not a member)."""
        if self.process_set_id is None or not self.included():
            return None
        return basics.rank() if self.ranks is None else self.ranks.index(basics.rank())

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (None until registered)."""
        if self.process_set_id is None:
            return None
        return self.ranks is None or basics.rank() in self.ranks

    def global_ranks(self) -> List[int]:
        """The set's members as global ranks, in set-rank order."""
        return list(range(basics.size())) if self.ranks is None else list(self.ranks)

    def controller(self) -> Any:
        """This set's negotiation (made on first use)."""
        if self._controller is None:
            from gigatron.engine.horovod.controller import Controller
            if not self.included():
                raise ValueError(f"rank {basics.rank()} is not a member of {self}: only its "
                                 f"ranks {self.ranks} may use it")
            self._controller = Controller(self.group, self.size() or 1, self.rank() or 0,
                                          self.global_ranks())
        return self._controller

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


class _GlobalProcessSet(ProcessSet):
    """Every rank, over the default group; id 0."""

    def __init__(self) -> None:
        super().__init__([])
        self.ranks = None


global_process_set: ProcessSet = _GlobalProcessSet()
_sets: Dict[int, ProcessSet] = {}


def resolve(process_set: Any) -> ProcessSet:
    """The registered set a `process_set=` argument names (the global one by default)."""
    if process_set is None:
        process_set = global_process_set
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"process_set must be a hvd.ProcessSet, got {type(process_set)}")
    basics.size()  # raises before hvd.init()
    if process_set is global_process_set and global_process_set.process_set_id is None:
        global_process_set.process_set_id = 0
    if process_set.process_set_id is None:
        raise ValueError(f"{process_set} is not registered: call hvd.add_process_set(...) on "
                         f"every rank first")
    return process_set


def add_process_set(process_set: Union[ProcessSet, Sequence[int]]) -> ProcessSet:
    """Register a new process set (every rank calls it, in the same order); returns it."""
    basics.size()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.process_set_id is not None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    ranks = process_set.global_ranks()
    bad = [r for r in ranks if not 0 <= r < basics.size()]
    if bad or not ranks:
        raise ValueError(f"process set ranks {ranks} must be ranks of this job "
                         f"(size {basics.size()})")
    if any(s.ranks == ranks for s in _sets.values()) or ranks == list(range(basics.size())):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    if dist.is_initialized() and basics.size() > 1:
        process_set.group = dist.new_group(ranks)
    process_set.process_set_id = max(_sets, default=0) + 1
    _sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank calls it); False if it was not registered or is
    the global one."""
    if process_set.process_set_id is None or process_set.process_set_id == 0 \
            or _sets.get(process_set.process_set_id) is not process_set:
        return False
    del _sets[process_set.process_set_id]
    group = process_set.group
    process_set._invalidate()
    if group is not None and dist.is_initialized():
        dist.destroy_process_group(group)
    return True


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Join the job (Horovod's hvd.init); `process_sets` are registered at once."""
    if comm is not None:
        basics.not_implemented("hvd.init(comm=...)", "call hvd.init() to use every launched rank")
    was = basics.is_initialized()
    basics.init()
    if not was:
        global_process_set.process_set_id = 0
    for ps in process_sets or ():
        if ps.process_set_id is None:
            add_process_set(ps)


def shutdown() -> None:
    """Leave the job (Horovod's hvd.shutdown); every process set is dropped."""
    for ps in list(_sets.values()):
        remove_process_set(ps)
    global_process_set._invalidate()
    basics.shutdown()
