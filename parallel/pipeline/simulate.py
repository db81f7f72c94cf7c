"""Run every rank's schedule against the others, without processes, and draw the result.

`simulate` proves a set of schedules can run: each message is matched with the neighbour's
receive in the same order on every (sender, receiver) channel (the identity of what is sent
must equal what is expected, or the executor would silently swap tensors of equal shape),
and no set of ranks waits on each other forever. Its model is strict, as NCCL is: a batch of
sends and receives completes only once the peer has posted every matching operation, so a
schedule that passes here cannot deadlock on gloo or NCCL. Messages to oneself (pp = 1 with
several chunks) are buffered, as the executor does. With a forward of `forward_time` and a
backward of `backward_time` (communication free) it also yields each rank's time line;
`render.py` prints it as a text grid so the bubble is visible.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from .schedules import (Backward, Forward, Instruction, RecvActivation,
                        SendActivation, SendGrad, comm_batches, peer)


class ScheduleError(ValueError):
    """A set of schedules that cannot run: mismatched messages or a deadlock."""


@dataclass
class SimulationResult:
    """Per-rank compute intervals (start, end, instruction) and the step's length."""

    timelines: List[List[Tuple[float, float, Instruction]]]
    makespan: float

    def busy(self, rank: int) -> float:
        return sum(end - start for start, end, _ in self.timelines[rank])

    def bubble_fraction(self, rank: int) -> float:
        """Share of the step this rank sits idle."""
        return 1.0 - self.busy(rank) / self.makespan if self.makespan else 0.0


def _message(op, pp_rank: int, pp_size: int) -> Tuple[Tuple[int, int], tuple]:
    """((sender, receiver), identity) of one communication instruction."""
    other, other_chunk = peer(op, pp_rank, pp_size)
    if isinstance(op, SendActivation):
        return (pp_rank, other), ("activation", op.microbatch, other_chunk)
    if isinstance(op, RecvActivation):
        return (other, pp_rank), ("activation", op.microbatch, op.chunk)
    if isinstance(op, SendGrad):
        return (pp_rank, other), ("grad", op.microbatch, other_chunk)
    return (other, pp_rank), ("grad", op.microbatch, op.chunk)


class _Channels:
    """Posted sends and receives per (sender, receiver), matched in posting order."""

    def __init__(self) -> None:
        self.sends: Dict[tuple, list] = defaultdict(list)  # [(identity, post time)]
        self.recvs: Dict[tuple, list] = defaultdict(list)

    def post(self, op, pp_rank: int, pp_size: int, now: float) -> Tuple[tuple, bool, int]:
        channel, identity = _message(op, pp_rank, pp_size)
        is_send = isinstance(op, (SendActivation, SendGrad))
        queue = self.sends[channel] if is_send else self.recvs[channel]
        queue.append((identity, now))
        index = len(queue) - 1
        self._check(channel, index)
        return channel, is_send, index

    def _check(self, channel: tuple, index: int) -> None:
        sends, recvs = self.sends[channel], self.recvs[channel]
        if index < len(sends) and index < len(recvs) and sends[index][0] != recvs[index][0]:
            raise ScheduleError(
                f"message {index} from pipeline rank {channel[0]} to {channel[1]}: sender "
                f"sends {sends[index][0]} but receiver expects {recvs[index][0]}")

    def done_at(self, channel: tuple, is_send: bool, index: int):
        """Completion time of one posted op, or None while its peer has not posted."""
        sends, recvs = self.sends[channel], self.recvs[channel]
        if channel[0] == channel[1] and is_send:
            return sends[index][1]  # to oneself: buffered
        if index < len(sends) and index < len(recvs):
            return max(sends[index][1], recvs[index][1])
        return None


def simulate(schedules: Sequence[Sequence[Instruction]], forward_time: float = 1.0,
             backward_time: float = 2.0) -> SimulationResult:
    """Execute all ranks' schedules (`schedules[pp_rank]`) together; raise on deadlock."""
    pp_size = len(schedules)
    steps = [comm_batches(s) for s in schedules]
    pc, clock = [0] * pp_size, [0.0] * pp_size
    posted: List[list] = [[] for _ in range(pp_size)]  # ops of the batch a rank waits on
    timelines: List[list] = [[] for _ in range(pp_size)]
    channels = _Channels()
    while any(pc[r] < len(steps[r]) for r in range(pp_size)):
        progress = False
        for r in range(pp_size):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if not isinstance(step, tuple):
                    duration = (forward_time if isinstance(step, Forward) else
                                backward_time if isinstance(step, Backward) else 0.0)
                    if duration:
                        timelines[r].append((clock[r], clock[r] + duration, step))
                    clock[r] += duration
                    pc[r] += 1
                    progress = True
                    continue
                if not posted[r]:
                    posted[r] = [channels.post(op, r, pp_size, clock[r]) for op in step]
                    progress = True
                times = [channels.done_at(*p) for p in posted[r]]
                if any(t is None for t in times):
                    break
                clock[r] = max([clock[r]] + times)
                posted[r] = []
                pc[r] += 1
                progress = True
        if not progress:
            blocked = {r: steps[r][pc[r]] for r in range(pp_size) if pc[r] < len(steps[r])}
            raise ScheduleError(f"deadlock: every unfinished rank waits on a batch its peer "
                                f"never posts: {blocked}")
    for channel in set(channels.sends) | set(channels.recvs):
        if len(channels.sends[channel]) != len(channels.recvs[channel]):
            raise ScheduleError(f"pipeline rank {channel[0]} sends "
                                f"{len(channels.sends[channel])} messages to {channel[1]}, "
                                f"which receives {len(channels.recvs[channel])}")
    return SimulationResult(timelines, max(clock) if clock else 0.0)


def simulate_step(pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                  forward_time: float = 1.0, backward_time: float = 2.0) -> SimulationResult:
    """Every rank's training schedule of one step, simulated together: a chunk's forward
    takes `forward_time`, its backward `backward_time` (per virtual chunk)."""
    from .schedules import build_schedule

    schedules = [build_schedule(r, pp_size, num_microbatches, virtual_chunks)
                 for r in range(pp_size)]
    return simulate(schedules, forward_time, backward_time)


def bubble_overhead(pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                    forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """Idle time over useful time of the step (the papers' bubble fraction): the simulated
    step's length over the busy time of one rank, minus one. 1F1B gives (p - 1) / m, the
    interleaved schedule (p - 1) / (v m) (Narayanan et al. 2021, sections 2.2.1-2.2.2)."""
    result = simulate_step(pp_size, num_microbatches, virtual_chunks, forward_time,
                           backward_time)
    busy = num_microbatches * virtual_chunks * (forward_time + backward_time)
    return result.makespan / busy - 1.0


def peak_in_flight(instructions: Sequence[Instruction],
                   chunk_weights: Sequence[float]) -> Tuple[float, List[int]]:
    """The most activation weight one rank holds at once under its schedule: forwards whose
    backward has not run yet, each weighted by its chunk's `chunk_weights[chunk]`; returns
    (peak weight, micro-batches in flight per chunk at that moment)."""
    held = [0] * len(chunk_weights)
    peak, at_peak = 0.0, list(held)
    for op in instructions:
        if isinstance(op, Forward):
            held[op.chunk] += 1
            weight = sum(n * w for n, w in zip(held, chunk_weights))
            if weight > peak:
                peak, at_peak = weight, list(held)
        elif isinstance(op, Backward):
            held[op.chunk] -= 1
    return peak, at_peak
