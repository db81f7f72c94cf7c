"""Pipeline schedules as data: each rank's ordered list of instructions for one training step.

A schedule is a pure function `(pp_rank, pp_size, num_microbatches, virtual_chunks) -> list`
so it can be tested without processes, simulated across all ranks (`simulate.py`),
printed, and run by the one executor (`executor.py`). It holds what differs between
schedules: compute and point-to-point messages. What every training step does after it
(wait for the gradient reductions, step the optimizer) is the training loop's, in that
order, so the executor owns no optimizer.

Instructions name a micro-batch and a model chunk (virtual pipeline stage on this rank):
`Forward`, `Backward`, and the point-to-point messages around them. Virtual stage
(chunk c, rank r) is stage c * pp + r of the model; activations flow to the next virtual
stage (rank r+1, or rank 0 of chunk c+1 after the last rank) and grads flow back.
Consecutive communication instructions form ONE batched isend/irecv (`comm_batches`), the
way Megatron pairs "send forward, receive backward": a rank's sends after a compute step
and the receives its next compute step needs are posted together, so neighbours never wait
on each other in a cycle even when every send is a rendezvous (NCCL).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple, Union

PP_FLAG = "--pipeline-model-parallel-size"
VIRTUAL_FLAG = "--num-layers-per-virtual-pipeline-stage"
BATCH_FLAGS = "--global-batch-size / (--micro-batch-size x data-parallel size)"


@dataclass(frozen=True)
class ScheduleNames:
    """How the caller's users name what `check_num_microbatches` checks: pretrain_gpt.py's
    flags by default; gigatron.pipe's engine passes DeepSpeed's words."""
    microbatches: str = BATCH_FLAGS
    pp: str = PP_FLAG
    virtual: str = VIRTUAL_FLAG
    fix: str = f"change --global-batch-size or drop {VIRTUAL_FLAG}"


FLAG_NAMES = ScheduleNames()


@dataclass(frozen=True)
class Forward:
    """Run model chunk `chunk` forward on micro-batch `microbatch`."""
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class Backward:
    """Backward of (microbatch, chunk): from the loss or the received output grad."""
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class RecvActivation:
    """Receive the input of Forward(microbatch, chunk) from the previous virtual stage."""
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class SendActivation:
    """Send the output of Forward(microbatch, chunk) to the next virtual stage."""
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class RecvGrad:
    """Receive the grad of Forward(microbatch, chunk)'s output from the next virtual stage."""
    microbatch: int
    chunk: int


@dataclass(frozen=True)
class SendGrad:
    """Send the grad of Forward(microbatch, chunk)'s input to the previous virtual stage."""
    microbatch: int
    chunk: int


Compute = Union[Forward, Backward]
Communication = Union[RecvActivation, SendActivation, RecvGrad, SendGrad]
Instruction = Union[Compute, Communication]
COMMUNICATION = (RecvActivation, SendActivation, RecvGrad, SendGrad)


def is_first_stage(pp_rank: int, chunk: int) -> bool:
    """The virtual stage holding the embedding (its forward reads the batch)."""
    return pp_rank == 0 and chunk == 0


def is_last_stage(pp_rank: int, chunk: int, pp_size: int, virtual_chunks: int) -> bool:
    """The virtual stage holding the output layer and the loss."""
    return pp_rank == pp_size - 1 and chunk == virtual_chunks - 1


def peer(op: Communication, pp_rank: int, pp_size: int) -> Tuple[int, int]:
    """(pipeline rank, chunk) at the other end of a message."""
    if isinstance(op, (SendActivation, RecvGrad)):  # towards the next virtual stage
        return (pp_rank + 1) % pp_size, op.chunk + (1 if pp_rank == pp_size - 1 else 0)
    return (pp_rank - 1) % pp_size, op.chunk - (1 if pp_rank == 0 else 0)


def message_boundary(op: Communication, pp_rank: int, pp_size: int) -> int:
    """Which stage boundary a message crosses: b for the output of virtual stage b (an
    activation sent to stage b + 1, or the grad received back for it). Both ends of a
    message compute the same number, so messages of variable shape can be told apart."""
    stage = op.chunk * pp_size + pp_rank
    return stage if isinstance(op, (SendActivation, RecvGrad)) else stage - 1


def check_num_microbatches(num_microbatches: int, pp_size: int, virtual_chunks: int,
                           names: ScheduleNames = FLAG_NAMES) -> None:
    """Raise a ValueError naming the settings (`names`) when a step's micro-batches cannot
    feed the schedule: the one home of the interleaved schedule's rule, for pretrain_gpt.py
    and gigatron.pipe's engine."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"the step has {num_microbatches!r} micro-batches "
                         f"({names.microbatches}); it needs at least 1")
    if not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"{names.pp} must be a positive integer, got {pp_size!r}")
    if not isinstance(virtual_chunks, int) or virtual_chunks < 1:
        raise ValueError(f"virtual chunks per stage ({names.virtual}) must be a positive "
                         f"integer, got {virtual_chunks!r}")
    if virtual_chunks > 1 and num_microbatches % pp_size:
        raise ValueError(
            f"the interleaved schedule ({names.virtual}) needs {names.microbatches} "
            f"({num_microbatches}) to be a multiple of {names.pp}={pp_size}, as Megatron "
            f"requires: {names.fix}")


def _with_communication(pp_rank: int, pp_size: int, virtual_chunks: int,
                        groups: Sequence[Sequence[Compute]]) -> List[Instruction]:
    """Between compute groups, one batch: the sends of the group before and the receives
    the group after needs (Megatron's send-forward-recv-backward pairing)."""
    def needs(step: Compute) -> List[Communication]:
        if isinstance(step, Forward):
            first = is_first_stage(pp_rank, step.chunk)
            return [] if first else [RecvActivation(step.microbatch, step.chunk)]
        last = is_last_stage(pp_rank, step.chunk, pp_size, virtual_chunks)
        return [] if last else [RecvGrad(step.microbatch, step.chunk)]

    def gives(step: Compute) -> List[Communication]:
        if isinstance(step, Forward):
            last = is_last_stage(pp_rank, step.chunk, pp_size, virtual_chunks)
            return [] if last else [SendActivation(step.microbatch, step.chunk)]
        first = is_first_stage(pp_rank, step.chunk)
        return [] if first else [SendGrad(step.microbatch, step.chunk)]

    out: List[Instruction] = []
    pending: List[Communication] = []
    for group in groups:
        out += pending + [op for step in group for op in needs(step)]
        out += list(group)
        pending = [op for step in group for op in gives(step)]
    return out + pending


def _finish(pp_rank: int, pp_size: int, virtual_chunks: int, groups: List[List[Compute]],
            forward_only: bool) -> List[Instruction]:
    if forward_only:
        groups = [[s] for g in groups for s in g if isinstance(s, Forward)]
    return _with_communication(pp_rank, pp_size, virtual_chunks, groups)


def _check_rank(pp_rank: int, pp_size: int) -> None:
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside 0..{pp_size - 1} "
                         f"({PP_FLAG}={pp_size})")


def no_pipelining(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                  forward_only: bool = False) -> List[Instruction]:
    """Gradient accumulation on one stage: each micro-batch forward then backward."""
    if pp_size != 1:
        raise ValueError(f"the no-pipelining schedule runs a single stage: {PP_FLAG} must be "
                         f"1, got {pp_size}; use one_f_one_b")
    _check_rank(pp_rank, pp_size)
    check_num_microbatches(num_microbatches, 1, 1)
    groups: List[List[Compute]] = []
    for mb in range(num_microbatches):
        groups += [[Forward(mb, c)] for c in range(virtual_chunks)]
        groups += [[Backward(mb, c)] for c in reversed(range(virtual_chunks))]
    return _finish(pp_rank, pp_size, virtual_chunks, groups, forward_only)


def one_f_one_b(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                forward_only: bool = False) -> List[Instruction]:
    """1F1B: pp - rank - 1 warm-up forwards, then one forward one backward, then cool-down."""
    if virtual_chunks != 1:
        raise ValueError(f"one_f_one_b runs one chunk per stage (got {virtual_chunks}); "
                         f"use interleaved_one_f_one_b for {VIRTUAL_FLAG}")
    _check_rank(pp_rank, pp_size)
    check_num_microbatches(num_microbatches, pp_size, 1)
    m = num_microbatches
    warmup = min(pp_size - pp_rank - 1, m)
    groups: List[List[Compute]] = [[Forward(mb, 0)] for mb in range(warmup)]
    for i in range(m - warmup):
        groups += [[Forward(warmup + i, 0)], [Backward(i, 0)]]
    groups += [[Backward(mb, 0)] for mb in range(m - warmup, m)]
    return _finish(pp_rank, pp_size, 1, groups, forward_only)


def _interleaved_step(k: int, pp_size: int, virtual_chunks: int, backward: bool) -> Tuple[int, int]:
    """(microbatch, chunk) of the k-th forward (or backward) on a rank: groups of pp_size
    micro-batches go through chunk 0, then chunk 1, ... (backward: last chunk first)."""
    group, within = divmod(k, pp_size * virtual_chunks)
    chunk = within // pp_size
    if backward:
        chunk = virtual_chunks - 1 - chunk
    return group * pp_size + within % pp_size, chunk


def interleaved_one_f_one_b(pp_rank: int, pp_size: int, num_microbatches: int,
                            virtual_chunks: int, forward_only: bool = False) -> List[Instruction]:
    """Interleaved 1F1B (Megatron): v chunks per rank shrink the bubble by a factor of v.

    Warm-up is (pp - rank - 1) * 2 + (v - 1) * pp forwards (all of them when m == pp);
    needs num_microbatches to be a multiple of pp.
    """
    _check_rank(pp_rank, pp_size)
    check_num_microbatches(num_microbatches, pp_size, max(virtual_chunks, 2))
    total = num_microbatches * virtual_chunks
    if num_microbatches == pp_size:
        warmup = total
    else:
        warmup = min((pp_size - pp_rank - 1) * 2 + (virtual_chunks - 1) * pp_size, total)

    def fwd(k: int) -> Forward:
        return Forward(*_interleaved_step(k, pp_size, virtual_chunks, backward=False))

    def bwd(k: int) -> Backward:
        return Backward(*_interleaved_step(k, pp_size, virtual_chunks, backward=True))

    # Steady state pairs a forward and a backward between two batches, as Megatron does:
    # posting "receive for the next backward" before the next forward keeps neighbours'
    # batches matched when chunks wrap around the ring.
    groups: List[List[Compute]] = [[fwd(k)] for k in range(warmup)]
    groups += [[fwd(warmup + i), bwd(i)] for i in range(total - warmup)]
    groups += [[bwd(k)] for k in range(total - warmup, total)]
    return _finish(pp_rank, pp_size, virtual_chunks, groups, forward_only)


def build_schedule(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                   forward_only: bool = False) -> List[Instruction]:
    """The schedule Megatron would pick: no pipelining, 1F1B, or interleaved 1F1B."""
    if pp_size == 1 and virtual_chunks == 1:
        return no_pipelining(pp_rank, pp_size, num_microbatches, 1, forward_only)
    if virtual_chunks == 1:
        return one_f_one_b(pp_rank, pp_size, num_microbatches, 1, forward_only)
    return interleaved_one_f_one_b(pp_rank, pp_size, num_microbatches, virtual_chunks,
                                   forward_only)


def comm_batches(instructions: Sequence[Instruction]) -> List[Union[Instruction, tuple]]:
    """Group each run of consecutive communication instructions into one tuple (one batch)."""
    steps: List[Union[Instruction, tuple]] = []
    run: List[Communication] = []
    for ins in instructions:
        if isinstance(ins, COMMUNICATION):
            run.append(ins)
            continue
        if run:
            steps.append(tuple(run))
            run = []
        steps.append(ins)
    if run:
        steps.append(tuple(run))
    return steps


def last_backward_per_chunk(instructions: Sequence[Instruction]) -> dict:
    """{chunk: microbatch of that chunk's last Backward}: where grad reduction may start."""
    last = {}
    for ins in instructions:
        if isinstance(ins, Backward):
            last[ins.chunk] = ins.microbatch
    return last
