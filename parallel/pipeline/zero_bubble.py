"""Zero-bubble pipeline schedules (Qi et al. 2023): ZB-H1 and ZB-V as instruction lists.

Both split each backward into B (the input gradient the previous stage waits for) and W
(the weight gradients, which nothing waits for), so W's can fill the idle time 1F1B leaves.
The cost model is the paper's (F = B = W = one unit per chunk, free communication):

- zb-h1: one chunk per stage; rank r runs 1F1B's warm-up plus one forward, then B, W, F per
  micro-batch with its W's delayed by r micro-batches (`_zb_h1_order`), so rank r holds
  1F1B's p - r micro-batches of activations (F to B) and r W stashes (B to W: the deferred
  linears' inputs and output gradients, parallel/tensor/wgrad.py), and the bubble is
  (p-1)(F+B-W), a third of 1F1B's (p-1)(F+B+W): a step of 3m + p - 1 units.
- zbv: two chunks per stage in a V (rank r holds stages r and 2pp-1-r). Found by list
  scheduling all ranks together (`list_schedule`): each rank, when free, runs the ready B
  (oldest micro-batch first), else a ready F if it holds fewer than 2pp chunks from F to W
  (activations or W stash: pp micro-batches, 1F1B's first-stage count, the stash being the
  smaller; the second chunk's first, which brings micro-batches to the loss sooner), else
  its oldest pending W. It reaches the bound 6m + p - 1 units (every
  rank busy from the moment its first input can arrive) for pp <= 4 and m >= pp, and
  stays within 4 units of it up to pp = 8, m = 32 (m >= pp).

Pass orders are turned into instructions the same way for both (`timed`, `_instructions`).
Messages: a receive is posted in the batch before the first compute that starts at or after
the message's arrival, so every rank posts the receive no later than its sender posts the
send (no stall under rendezvous sends) and a channel's messages are received in the order
they were sent.
"""
from __future__ import annotations

from bisect import bisect_left
from functools import lru_cache
from typing import Dict, List, Optional, Tuple

from .schedules import (FLAG_NAMES, Backward, Communication, Compute, Forward, Instruction,
                        RecvActivation, RecvGrad, ScheduleNames, SendActivation, SendGrad,
                        WeightGrad, _check_rank, _with_communication, check_num_microbatches,
                        stage_position, virtual_stage)

Timed = Tuple[int, Compute]  # (start time in units, compute instruction)


class _Ranks:
    """The list scheduler's state: what each stage has run and when it finished."""

    def __init__(self, pp_size: int, num_microbatches: int, chunks: int, placement: str):
        self.pp, self.m, self.chunks, self.placement = pp_size, num_microbatches, chunks, placement
        self.stages = pp_size * chunks
        self.done: Dict[tuple, int] = {}  # (kind, microbatch, stage) -> end time
        self.next = {(kind, s): 0 for kind in "FB" for s in range(self.stages)}
        self.held = [0] * pp_size
        self.pending_w: List[List[Tuple[int, int]]] = [[] for _ in range(pp_size)]
        self.timelines: List[List[Timed]] = [[] for _ in range(pp_size)]

    def my_stages(self, rank: int) -> List[int]:
        return [virtual_stage(rank, c, self.pp, self.placement) for c in range(self.chunks)]

    def ready(self, kind: str, stage: int, now: int) -> Optional[int]:
        """The micro-batch whose `kind` pass can start on `stage` at `now`, if any."""
        mb = self.next[(kind, stage)]
        if mb >= self.m:
            return None
        op = Forward(mb, 0) if kind == "F" else Backward(mb, 0)
        needs = _needs(op, stage, self.stages - 1)
        return mb if all(self.done.get(need, now + 1) <= now for need in needs) else None

    def run(self, rank: int, kind: str, mb: int, stage: int, now: int) -> None:
        chunk = stage_position(stage, self.pp, self.placement)[1]
        op: Compute = (Forward(mb, chunk) if kind == "F" else Backward(mb, chunk)
                       if kind == "B" else WeightGrad(mb, chunk))
        self.timelines[rank].append((now, op))
        self.done[(kind, mb, stage)] = now + 1
        if kind in "FB":
            self.next[(kind, stage)] += 1
        self.held[rank] += {"F": 1, "B": 0, "W": -1}[kind]
        if kind == "B":
            self.pending_w[rank].append((mb, stage))


def _choose(state: _Ranks, rank: int, now: int, limit: int) -> Optional[Tuple[str, int, int]]:
    """What `rank` runs at `now`: a ready B, else a ready F within memory, else a W."""
    stages = state.my_stages(rank)
    backs = [(mb, -s) for s in stages if (mb := state.ready("B", s, now)) is not None]
    if backs:
        mb, s = min(backs)
        return "B", mb, -s
    if state.held[rank] < limit:
        fwds = [(-s, mb) for s in stages if (mb := state.ready("F", s, now)) is not None]
        if fwds:
            s, mb = min(fwds)
            return "F", mb, -s
    if state.pending_w[rank]:
        mb, s = state.pending_w[rank].pop(0)
        return "W", mb, s
    return None


def list_schedule(pp_size: int, num_microbatches: int, chunks: int, placement: str,
                  limits: List[int]) -> List[List[Timed]]:
    """Every rank's timed F, B and W passes (unit times), greedily as the module says."""
    state = _Ranks(pp_size, num_microbatches, chunks, placement)
    total = 3 * num_microbatches * state.stages
    free_at, now, ran = [0] * pp_size, 0, 0
    while ran < total:
        for rank in range(pp_size):
            if free_at[rank] > now:
                continue
            choice = _choose(state, rank, now, limits[rank])
            if choice is not None:
                state.run(rank, *choice, now)
                free_at[rank], ran = now + 1, ran + 1
        now += 1
        if now > 2 * total + 2 * state.stages:  # every pass waits: the cap is too small
            raise ValueError(f"no {placement} schedule within the memory caps {limits}")
    return state.timelines


def _needs(op: Compute, stage: int, last: int) -> List[tuple]:
    """The passes (kind, microbatch, stage) that must finish before `op` at `stage` starts."""
    mb = op.microbatch
    if isinstance(op, Forward):
        return [("F", mb, stage - 1)] if stage else []
    if isinstance(op, Backward):
        return [("F", mb, stage)] + ([("B", mb, stage + 1)] if stage < last else [])
    return [("B", mb, stage)]


def timed(orders: List[List[Compute]], chunks: int, placement: str) -> List[List[Timed]]:
    """Start times (unit passes, free communication) of every rank's passes in its order,
    each as soon as its rank is free and what it needs is done."""
    pp_size, last = len(orders), len(orders) * chunks - 1
    kind = {Forward: "F", Backward: "B", WeightGrad: "W"}
    done: Dict[tuple, int] = {}
    clock, pc = [0] * pp_size, [0] * pp_size
    timelines: List[List[Timed]] = [[] for _ in range(pp_size)]
    while any(pc[r] < len(orders[r]) for r in range(pp_size)):
        progress = False
        for rank in range(pp_size):
            while pc[rank] < len(orders[rank]):
                op = orders[rank][pc[rank]]
                stage = virtual_stage(rank, op.chunk, pp_size, placement)
                needs = _needs(op, stage, last)
                if any(need not in done for need in needs):
                    break
                start = max([clock[rank]] + [done[need] for need in needs])
                timelines[rank].append((start, op))
                done[(kind[type(op)], op.microbatch, stage)] = clock[rank] = start + 1
                pc[rank], progress = pc[rank] + 1, True
        if not progress:
            raise ValueError(f"the pass orders deadlock at {[o[:1] for o in orders]}")
    return timelines


def _messages(timelines: List[List[Timed]], pp_size: int, chunks: int,
              placement: str) -> Tuple[List[Dict[int, List[Communication]]], List[list]]:
    """Per rank: {index of a compute: sends after it}, and [(arrival, receive)]."""
    last = pp_size * chunks - 1
    sends: List[Dict[int, List[Communication]]] = [{} for _ in range(pp_size)]
    recvs: List[list] = [[] for _ in range(pp_size)]
    for rank, timeline in enumerate(timelines):
        for index, (start, op) in enumerate(timeline):
            stage = virtual_stage(rank, op.chunk, pp_size, placement)
            kinds: tuple
            if isinstance(op, Forward) and stage < last:
                to, kinds = stage + 1, (SendActivation, RecvActivation)
            elif isinstance(op, Backward) and stage > 0:
                to, kinds = stage - 1, (SendGrad, RecvGrad)
            else:
                continue
            other, other_chunk = stage_position(to, pp_size, placement)
            if other == rank and placement == "v":
                continue  # the V's turn on the last rank: chunk 0 hands chunk 1 its tensor
            sends[rank].setdefault(index, []).append(kinds[0](op.microbatch, op.chunk))
            recvs[other].append((start + 1, kinds[1](op.microbatch, other_chunk)))
    return sends, recvs


def _instructions(timeline: List[Timed], sends: Dict[int, List[Communication]],
                  recvs: list) -> List[Instruction]:
    """One rank's list: before each compute, the sends of the one before and the receives
    of the messages that have arrived by the time it starts."""
    batches: List[List[Communication]] = [[] for _ in range(len(timeline) + 1)]
    starts = [start for start, _ in timeline]
    for arrival, op in sorted(recvs, key=lambda x: x[0]):  # starts increase: bisect
        batches[bisect_left(starts, arrival)].append(op)
    out: List[Instruction] = []
    for index, (_, op) in enumerate(timeline):
        out += sends.get(index - 1, []) + batches[index] + [op]
    return out + sends.get(len(timeline) - 1, [])


def _zb_h1_order(pp_rank: int, pp_size: int, num_microbatches: int) -> List[Compute]:
    """Rank r: 1F1B's warm-up plus one forward, then B, W, F per micro-batch with its W's
    delayed by r micro-batches, so rank r holds p - r micro-batches from F to B (1F1B's
    count) and r from B to W, and the W's fill the cool-down where 1F1B idles."""
    m, first = num_microbatches, min(pp_size - pp_rank, num_microbatches)
    order: List[Compute] = [Forward(mb, 0) for mb in range(first)]
    for i in range(m):
        order.append(Backward(i, 0))
        if i >= pp_rank:
            order.append(WeightGrad(i - pp_rank, 0))
        if first + i < m:
            order.append(Forward(first + i, 0))
    return order + [WeightGrad(mb, 0) for mb in range(max(m - pp_rank, 0), m)]


def zb_h1(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
          forward_only: bool = False, names: ScheduleNames = FLAG_NAMES) -> List[Instruction]:
    """ZB-H1: 1F1B's activations plus W stashes, W's moved into the cool-down's bubbles."""
    _check_rank(pp_rank, pp_size)
    check_num_microbatches(num_microbatches, pp_size, 1, names)
    if forward_only:
        return _with_communication(pp_rank, pp_size, 1,
                                   [[Forward(mb, 0)] for mb in range(num_microbatches)])
    return list(_pipeline(pp_size, num_microbatches, "zb-h1")[pp_rank])


def zbv(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int = 2,
        forward_only: bool = False, names: ScheduleNames = FLAG_NAMES) -> List[Instruction]:
    """ZB-V: two chunks per stage in a V, near-zero bubble, at most pp micro-batches from
    F to W on every rank (1F1B's first-stage count)."""
    _check_rank(pp_rank, pp_size)
    check_num_microbatches(num_microbatches, pp_size, 1, names)
    if forward_only:
        groups = [[Forward(mb, c)] for c in (0, 1) for mb in range(num_microbatches)]
        return _with_communication(pp_rank, pp_size, 2, groups, "v")
    return list(_pipeline(pp_size, num_microbatches, "zbv")[pp_rank])


@lru_cache(maxsize=16)
def _pipeline(pp_size: int, num_microbatches: int,
              schedule: str) -> Tuple[Tuple[Instruction, ...], ...]:
    """Every rank's training instructions of zb-h1 or zbv. The passes are placed for all
    ranks together, so each shape is built once, not once per rank (`gigatron plan
    --search` reads every rank's of many shapes; instructions are frozen)."""
    if schedule == "zb-h1":
        orders = [_zb_h1_order(r, pp_size, num_microbatches) for r in range(pp_size)]
        timelines, chunks, placement = timed(orders, 1, "loop"), 1, "loop"
    else:
        timelines, chunks, placement = list_schedule(
            pp_size, num_microbatches, 2, "v", [2 * pp_size] * pp_size), 2, "v"
    sends, recvs = _messages(timelines, pp_size, chunks, placement)
    return tuple(tuple(_instructions(timelines[r], sends[r], recvs[r]))
                 for r in range(pp_size))
