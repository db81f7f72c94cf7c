"""Pipeline schedules as data: each rank's ordered list of instructions for one training step.

A schedule is a pure function `(pp_rank, pp_size, num_microbatches, virtual_chunks) -> list`
so it can be tested without processes, simulated across all ranks (`simulate.py`),
printed, and run by the one executor (`executor.py`). It holds what differs between
schedules: compute and point-to-point messages. What every training step does after it
(wait for the gradient reductions, step the optimizer) is the training loop's, in that
order, so the executor owns no optimizer.

Instructions name a micro-batch and a model chunk (virtual pipeline stage on this rank):
`Forward`, `Backward`, `WeightGrad` and the point-to-point messages around them. Where chunks
sit is the schedule's placement: "loop" (1F1B, interleaved) puts virtual stage c * pp + r on
(chunk c, rank r), activations flowing to rank r+1, or rank 0 of chunk c+1 after the last
rank; "v" (zbv) puts chunk 0 on ranks 0..pp-1 and chunk 1 back on ranks pp-1..0, so rank r
holds stages r and 2pp-1-r, the loss is on rank 0, and the activation from chunk 0 to chunk 1
on the last rank stays local (no message). Grads flow back the same way.

Split backward (the zero-bubble schedules, Qi et al. 2023): a `Backward` followed later in
the same rank's list by a `WeightGrad` of the same (microbatch, chunk) computes only the
input gradient (B, what the previous stage waits for); the `WeightGrad` (W) computes the
weight gradients, and the activations it needs are held until it runs. A `Backward` with no
`WeightGrad` after it (1F1B, interleaved: they emit none) is the full backward, as before.
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
SCHEDULE_FLAG = "--pipeline-schedule"
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "zbv")


@dataclass(frozen=True)
class ScheduleNames:
    """How the caller's users name what `check_num_microbatches` checks: pretrain_gpt.py's
    flags by default; gigatron.pipe's engine passes DeepSpeed's words."""
    microbatches: str = BATCH_FLAGS
    pp: str = PP_FLAG
    virtual: str = VIRTUAL_FLAG
    fix: str = f"change --global-batch-size or drop {VIRTUAL_FLAG}"
    schedule: str = SCHEDULE_FLAG


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
class WeightGrad:
    """Weight gradients of (microbatch, chunk), after its input-gradient `Backward` (split)."""
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


Compute = Union[Forward, Backward, WeightGrad]
Communication = Union[RecvActivation, SendActivation, RecvGrad, SendGrad]
Instruction = Union[Compute, Communication]
COMMUNICATION = (RecvActivation, SendActivation, RecvGrad, SendGrad)


def placement_of(schedule: str) -> str:
    """Where a schedule puts its chunks: "v" for zbv, "loop" for the others."""
    return "v" if schedule == "zbv" else "loop"


def virtual_stage(pp_rank: int, chunk: int, pp_size: int, placement: str = "loop") -> int:
    """Which stage of the model (chunk, rank) holds: the V runs odd chunks backwards."""
    if placement == "v" and chunk % 2:
        return chunk * pp_size + pp_size - 1 - pp_rank
    return chunk * pp_size + pp_rank


def stage_position(stage: int, pp_size: int, placement: str = "loop") -> Tuple[int, int]:
    """(pipeline rank, chunk) holding virtual stage `stage`: the inverse of virtual_stage."""
    chunk, within = divmod(stage, pp_size)
    if placement == "v" and chunk % 2:
        return pp_size - 1 - within, chunk
    return within, chunk


def is_first_stage(pp_rank: int, chunk: int, pp_size: int = 1, placement: str = "loop") -> bool:
    """The virtual stage holding the embedding (its forward reads the batch)."""
    return virtual_stage(pp_rank, chunk, pp_size, placement) == 0


def is_last_stage(pp_rank: int, chunk: int, pp_size: int, virtual_chunks: int,
                  placement: str = "loop") -> bool:
    """The virtual stage holding the output layer and the loss."""
    return (chunk == virtual_chunks - 1 and
            virtual_stage(pp_rank, chunk, pp_size, placement) == pp_size * virtual_chunks - 1)


def peer(op: Communication, pp_rank: int, pp_size: int,
         placement: str = "loop") -> Tuple[int, int]:
    """(pipeline rank, chunk) at the other end of a message."""
    step = 1 if isinstance(op, (SendActivation, RecvGrad)) else -1  # towards the next stage
    return stage_position(virtual_stage(pp_rank, op.chunk, pp_size, placement) + step,
                          pp_size, placement)


def message_boundary(op: Communication, pp_rank: int, pp_size: int,
                     placement: str = "loop") -> int:
    """Which stage boundary a message crosses: b for the output of virtual stage b (an
    activation sent to stage b + 1, or the grad received back for it). Both ends of a
    message compute the same number, so messages of variable shape can be told apart."""
    stage = virtual_stage(pp_rank, op.chunk, pp_size, placement)
    return stage if isinstance(op, (SendActivation, RecvGrad)) else stage - 1


def is_local(op: Communication, pp_rank: int, pp_size: int, placement: str) -> bool:
    """A message between two chunks of one rank that the V placement keeps local (no p2p);
    the loop placement (pp = 1 interleaved) keeps its buffered messages to itself."""
    return placement == "v" and peer(op, pp_rank, pp_size, placement)[0] == pp_rank


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
                        groups: Sequence[Sequence[Compute]],
                        placement: str = "loop") -> List[Instruction]:
    """Between compute groups, one batch: the sends of the group before and the receives
    the group after needs (Megatron's send-forward-recv-backward pairing)."""
    def needs(step: Compute) -> List[Communication]:
        ops: List[Communication]
        if isinstance(step, Forward):
            first = is_first_stage(pp_rank, step.chunk, pp_size, placement)
            ops = [] if first else [RecvActivation(step.microbatch, step.chunk)]
        elif isinstance(step, Backward):
            last = is_last_stage(pp_rank, step.chunk, pp_size, virtual_chunks, placement)
            ops = [] if last else [RecvGrad(step.microbatch, step.chunk)]
        else:
            ops = []
        return [op for op in ops if not is_local(op, pp_rank, pp_size, placement)]

    def gives(step: Compute) -> List[Communication]:
        ops: List[Communication]
        if isinstance(step, Forward):
            last = is_last_stage(pp_rank, step.chunk, pp_size, virtual_chunks, placement)
            ops = [] if last else [SendActivation(step.microbatch, step.chunk)]
        elif isinstance(step, Backward):
            first = is_first_stage(pp_rank, step.chunk, pp_size, placement)
            ops = [] if first else [SendGrad(step.microbatch, step.chunk)]
        else:
            ops = []
        return [op for op in ops if not is_local(op, pp_rank, pp_size, placement)]

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


def check_schedule_choice(schedule: str, virtual_chunks: int,
                          names: ScheduleNames = FLAG_NAMES) -> None:
    """Raise a ValueError naming the flags when `schedule` cannot run this layout."""
    if schedule not in SCHEDULES:
        raise ValueError(f"{names.schedule} {schedule!r} is not one of {', '.join(SCHEDULES)}")
    if schedule == "interleaved" and virtual_chunks < 2:
        raise ValueError(f"{names.schedule} interleaved needs 2 or more virtual chunks per "
                         f"stage: give {names.virtual}, or use {names.schedule} 1f1b")
    if schedule == "zb-h1" and virtual_chunks != 1:
        raise ValueError(f"{names.schedule} zb-h1 runs one chunk per stage (got "
                         f"{virtual_chunks} from {names.virtual}): drop {names.virtual} "
                         f"or use {names.schedule} zbv")
    if schedule == "zbv" and virtual_chunks != 2:
        raise ValueError(f"{names.schedule} zbv places exactly 2 chunks per stage in a V "
                         f"(got {virtual_chunks} from {names.virtual}): set it to give 2")


def schedule_problems(schedule: str, virtual_chunks: int, tied_embeddings: bool,
                      zero_stage: int) -> List[str]:
    """pretrain_gpt.py's one-line problems with --pipeline-schedule on this layout."""
    try:
        check_schedule_choice(schedule, virtual_chunks)
    except ValueError as e:
        return [str(e)]
    lines = []
    if schedule == "zbv" and tied_embeddings:
        # the V puts the embedding and the output layer on rank 0 as two chunks: the tied
        # copies' grads would need a local sum the embedding group does not do
        lines.append(f"{SCHEDULE_FLAG} zbv needs --untie-embeddings-and-output-weights")
    if schedule in ("zb-h1", "zbv") and zero_stage == 3:
        lines.append(f"{SCHEDULE_FLAG} {schedule} defers weight gradients past the backward "
                     f"that ZeRO stage 3 gathers parameters for: use --zero-stage 0, 1 or 2")
    return lines


def build_schedule(pp_rank: int, pp_size: int, num_microbatches: int, virtual_chunks: int = 1,
                   forward_only: bool = False, schedule: str = "1f1b",
                   names: ScheduleNames = FLAG_NAMES) -> List[Instruction]:
    """The schedule by name; "1f1b" is the one Megatron would pick: no pipelining, 1F1B, or
    interleaved 1F1B (with virtual chunks)."""
    check_schedule_choice(schedule, virtual_chunks, names)
    if schedule in ("zb-h1", "zbv"):
        from .zero_bubble import zb_h1, zbv  # it builds on this module's instructions

        build = zb_h1 if schedule == "zb-h1" else zbv
        return build(pp_rank, pp_size, num_microbatches, virtual_chunks, forward_only, names)
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


def last_grad_step_per_chunk(instructions: Sequence[Instruction]) -> dict:
    """{chunk: its last Backward or WeightGrad}: the step after which its gradients are
    complete, where grad reduction may start (a split schedule's last W)."""
    last = {}
    for ins in instructions:
        if isinstance(ins, (Backward, WeightGrad)):
            last[ins.chunk] = ins
    return last
