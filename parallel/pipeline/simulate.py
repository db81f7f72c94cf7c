"""Run every rank's schedule against the others, without processes, and draw the result.

`simulate` proves a set of schedules can run: each message is matched with the neighbour's
receive in the same order on every (sender, receiver) channel (the identity of what is sent
must equal what is expected, or the executor would silently swap tensors of equal shape),
and no set of ranks waits on each other forever. Its model is strict, as NCCL is: a batch of
sends and receives completes only once the peer has posted every matching operation, so a
schedule that passes here cannot deadlock on gloo or NCCL. Messages to oneself (pp = 1 with
several chunks) are buffered, as the executor does. With a forward of `forward_time` and a
backward of `backward_time` (communication free) it also yields each rank's time line;
`render.py` prints it as a text grid so the bubble is visible. A split backward (a Backward
with its WeightGrad later, see schedules.py) takes `backward_time - weight_time` and its W
`weight_time` (default: half the backward each), so F = B = W with the defaults 1, 2.
It then checks the order of the passes across ranks (`check_dependencies`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from .schedules import (Backward, Forward, Instruction, RecvActivation, SendActivation,
                        SendGrad, WeightGrad, comm_batches, peer, placement_of,
                        virtual_stage)


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

    def mean_bubble_fraction(self) -> float:
        """Idle share of the step, mean over ranks (the figure `gigatron schedule` prints)."""
        return sum(map(self.bubble_fraction, range(len(self.timelines)))) / len(self.timelines)


def _message(op, pp_rank: int, pp_size: int,
             placement: str) -> Tuple[Tuple[int, int], tuple]:
    """((sender, receiver), identity) of one communication instruction."""
    other, other_chunk = peer(op, pp_rank, pp_size, placement)
    if isinstance(op, SendActivation):
        return (pp_rank, other), ("activation", op.microbatch, other_chunk)
    if isinstance(op, RecvActivation):
        return (other, pp_rank), ("activation", op.microbatch, op.chunk)
    if isinstance(op, SendGrad):
        return (pp_rank, other), ("grad", op.microbatch, other_chunk)
    return (other, pp_rank), ("grad", op.microbatch, op.chunk)


class _Channels:
    """Posted sends and receives per (sender, receiver), matched in posting order."""

    def __init__(self, placement: str) -> None:
        self.placement = placement
        self.sends: Dict[tuple, list] = defaultdict(list)  # [(identity, post time)]
        self.recvs: Dict[tuple, list] = defaultdict(list)

    def post(self, op, pp_rank: int, pp_size: int, now: float) -> Tuple[tuple, bool, int]:
        channel, identity = _message(op, pp_rank, pp_size, self.placement)
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

    def parties(self, channel: tuple, is_send: bool, index: int) -> Optional[tuple]:
        """What one posted op's completion waits on: the post values (times, or program
        slots) of both ends, or its own to oneself (buffered); None while its peer has not
        posted."""
        sends, recvs = self.sends[channel], self.recvs[channel]
        if channel[0] == channel[1] and is_send:
            return (sends[index][1],)
        if index < len(sends) and index < len(recvs):
            return (sends[index][1], recvs[index][1])
        return None


def _kinds(schedule: Sequence[Instruction]) -> Dict[Instruction, str]:
    """Each compute instruction's kind of time: F, B (a whole backward), b (a Backward whose
    W comes later: B only) or W."""
    split = {(op.microbatch, op.chunk) for op in schedule if isinstance(op, WeightGrad)}
    kinds: Dict[Instruction, str] = {}
    for op in schedule:
        if isinstance(op, Forward):
            kinds[op] = "F"
        elif isinstance(op, Backward):
            kinds[op] = "B" if (op.microbatch, op.chunk) not in split else "b"
        elif isinstance(op, WeightGrad):
            kinds[op] = "W"
    return kinds


@dataclass(frozen=True)
class StepProgram:
    """What the simulation does with the ranks' clocks, in its order, without the times:
    ("c", rank, instruction, kind) runs a pass; ("p", rank, slot) posts one op of a batch at
    the rank's clock; ("w", rank, parties) ends a batch when each op's parties (slots) have
    posted. Which rank waits on which post does not depend on the times, so one program
    serves every (F, B, W) (`gigatron plan --search` times thousands on a few shapes)."""

    pp_size: int
    ops: Tuple[tuple, ...]
    slots: int


def compile_step(schedules: Sequence[Sequence[Instruction]],
                 placement: str = "loop") -> StepProgram:
    """Match every rank's sends and receives and order the ranks' steps (`simulate`'s
    checks: message identities, deadlock, unmatched messages), recording `StepProgram`."""
    pp_size = len(schedules)
    kinds = [_kinds(s) for s in schedules]
    steps = [comm_batches(s) for s in schedules]
    pc, slots = [0] * pp_size, 0
    posted: List[list] = [[] for _ in range(pp_size)]  # ops of the batch a rank waits on
    ops: List[tuple] = []
    channels = _Channels(placement)
    while any(pc[r] < len(steps[r]) for r in range(pp_size)):
        progress = False
        for r in range(pp_size):
            while pc[r] < len(steps[r]):
                step = steps[r][pc[r]]
                if not isinstance(step, tuple):
                    if step in kinds[r]:
                        ops.append(("c", r, step, kinds[r][step]))
                    pc[r] += 1
                    progress = True
                    continue
                if not posted[r]:
                    for op in step:
                        ops.append(("p", r, slots))
                        posted[r].append(channels.post(op, r, pp_size, slots))
                        slots += 1
                    progress = True
                parties = [channels.parties(*p) for p in posted[r]]
                if any(p is None for p in parties):
                    break
                ops.append(("w", r, tuple(parties)))
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
    return StepProgram(pp_size, tuple(ops), slots)


def run_step(program: StepProgram, forward_time: float, backward_time: float,
             weight_time: float, timelines: bool = True) -> SimulationResult:
    """The program's clocks at these times (a batch ends at the latest of the rank's clock
    and its ops' parties' posts); `timelines` False: the makespan only."""
    times = {"F": forward_time, "B": backward_time, "b": backward_time - weight_time,
             "W": weight_time}
    clock, posts = [0.0] * program.pp_size, [0.0] * program.slots
    lines: List[list] = [[] for _ in range(program.pp_size)]
    for op in program.ops:
        tag, r = op[0], op[1]
        if tag == "c":
            duration = times[op[3]]
            if duration and timelines:
                lines[r].append((clock[r], clock[r] + duration, op[2]))
            clock[r] += duration
        elif tag == "p":
            posts[op[2]] = clock[r]
        else:
            clock[r] = max([clock[r]] + [max(posts[s] for s in parties) for parties in op[2]])
    return SimulationResult(lines, max(clock) if clock else 0.0)


def simulate(schedules: Sequence[Sequence[Instruction]], forward_time: float = 1.0,
             backward_time: float = 2.0, weight_time: Optional[float] = None,
             placement: str = "loop") -> SimulationResult:
    """Execute all ranks' schedules (`schedules[pp_rank]`) together; raise on deadlock or
    on passes out of dependency order."""
    weight = backward_time / 2 if weight_time is None else weight_time
    result = run_step(compile_step(schedules, placement), forward_time, backward_time, weight)
    check_dependencies(result, placement)
    return result


def check_dependencies(result: SimulationResult, placement: str = "loop") -> None:
    """Raise a ScheduleError unless every pass runs once and after what it needs: F after
    the previous stage's F, B after its F and the next stage's B, W after its B."""
    pp_size = len(result.timelines)
    passes: Dict[tuple, Tuple[float, float]] = {}  # (kind, microbatch, stage) -> (start, end)
    for rank, timeline in enumerate(result.timelines):
        for start, end, op in timeline:
            key = (type(op).__name__, op.microbatch,
                   virtual_stage(rank, op.chunk, pp_size, placement))
            if key in passes:
                raise ScheduleError(f"{key[0]} of micro-batch {key[1]} at stage {key[2]} "
                                    f"runs twice")
            passes[key] = (start, end)
    last = max((stage for _, _, stage in passes), default=0)
    for (kind, mb, stage), (start, _) in passes.items():
        if kind == "Forward":
            needs = [("Forward", mb, stage - 1)] if stage else []
        elif kind == "Backward":
            needs = [("Forward", mb, stage)] + ([("Backward", mb, stage + 1)]
                                                 if stage < last else [])
        else:
            needs = [("Backward", mb, stage)]
        for need in needs:
            if need not in passes or passes[need][1] > start + 1e-9:
                raise ScheduleError(f"{kind} of micro-batch {mb} at stage {stage} starts "
                                    f"before {need[0]} of stage {need[2]} has finished")


def simulate_step(pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                  forward_time: float = 1.0, backward_time: float = 2.0,
                  schedule: str = "1f1b") -> SimulationResult:
    """Every rank's training schedule of one step, simulated together: a chunk's forward
    takes `forward_time`, its backward `backward_time` (per virtual chunk; a split one is
    half B, half W)."""
    from .schedules import build_schedule

    schedules = [build_schedule(r, pp_size, num_microbatches, virtual_chunks,
                                schedule=schedule) for r in range(pp_size)]
    return simulate(schedules, forward_time, backward_time,
                    placement=placement_of(schedule))


def bubble_overhead(pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                    forward_time: float = 1.0, backward_time: float = 2.0) -> float:
    """Idle time over useful time of the step (the papers' bubble fraction): the simulated
    step's length over the busy time of one rank, minus one. 1F1B gives (p - 1) / m, the
    interleaved schedule (p - 1) / (v m) (Narayanan et al. 2021, sections 2.2.1-2.2.2)."""
    result = simulate_step(pp_size, num_microbatches, virtual_chunks, forward_time,
                           backward_time)
    busy = num_microbatches * virtual_chunks * (forward_time + backward_time)
    return result.makespan / busy - 1.0


def held_after_each_pass(instructions: Sequence[Instruction],
                         virtual_chunks: int) -> List[Tuple[List[int], List[int]]]:
    """After each forward, backward and W of one rank's schedule: (per chunk, micro-batches
    whose activations are held: F done, B not yet; micro-batches whose W stash is held: a
    split backward's B done, its W not yet)."""
    split = {(op.microbatch, op.chunk) for op in instructions if isinstance(op, WeightGrad)}
    held, stashed = [0] * virtual_chunks, [0] * virtual_chunks
    out: List[Tuple[List[int], List[int]]] = []
    for op in instructions:
        if isinstance(op, Forward):
            held[op.chunk] += 1
        elif isinstance(op, Backward):
            held[op.chunk] -= 1
            stashed[op.chunk] += (op.microbatch, op.chunk) in split
        elif isinstance(op, WeightGrad):
            stashed[op.chunk] -= 1
        else:
            continue
        out.append((list(held), list(stashed)))
    return out


def peak_in_flight(instructions: Sequence[Instruction], chunk_weights: Sequence[float],
                   stash_weights: Optional[Sequence[float]] = None
                   ) -> Tuple[float, List[int], List[int]]:
    """The most memory one rank holds at once under its schedule: each forward's
    activations (`chunk_weights[chunk]`) until its backward (B when split), then a split
    backward's W stash (`stash_weights[chunk]`, default none) until its W; returns (peak,
    micro-batches per chunk with activations held then, with a W stash held then)."""
    return peak_of_states(held_after_each_pass(instructions, len(chunk_weights)),
                          chunk_weights, stash_weights)


def peak_of_states(states: Iterable[Tuple[Sequence[int], Sequence[int]]],
                   chunk_weights: Sequence[float],
                   stash_weights: Optional[Sequence[float]] = None
                   ) -> Tuple[float, List[int], List[int]]:
    """`peak_in_flight` over `held_after_each_pass`'s states (the first state reaching the
    peak; a state seen before cannot be the first, so the distinct states give the same)."""
    stash = [0.0] * len(chunk_weights) if stash_weights is None else stash_weights
    peak, at_peak = 0.0, ([0] * len(chunk_weights), [0] * len(chunk_weights))
    for held, stashed in states:
        weight = sum(n * w for n, w in zip(held, chunk_weights)) + \
            sum(n * w for n, w in zip(stashed, stash))
        if weight > peak:
            peak, at_peak = weight, (list(held), list(stashed))
    return peak, at_peak[0], at_peak[1]


def peak_activations(schedules: Sequence[Sequence[Instruction]], virtual_chunks: int) -> float:
    """The most micro-batches' activations (F to B) any rank holds at once, in whole-stage
    units (a chunk's forward holds 1 / virtual_chunks of a stage's); W stashes not counted."""
    return max(peak_in_flight(s, [1.0 / virtual_chunks] * virtual_chunks)[0]
               for s in schedules)
