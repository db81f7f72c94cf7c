"""The one executor that runs any pipeline schedule (a list of instructions) on this rank.

It owns nothing but the bookkeeping of one step: which stage inputs, outputs and grads are
alive. It knows no model: the model's `MicroBatchStep` (interfaces.py) says how a chunk is
called on a micro-batch, what the last stage's loss is (a `StageLoss`) and which losses the
chunk's layers added on the way. Backward of micro-batch losses (with their auxiliary and
layer losses) is scaled by `loss_scale / num_microbatches`, so grads are those of the mean
loss over the step's micro-batches (gradient accumulation); a caller may divide by another
`loss_divisor` instead (Megatron's --calculate-per-token-loss: losses are sums over tokens,
divided by the step's token count). `run` returns the micro-batch losses; the auxiliary and
layer losses, summed over the micro-batches by name, are in `aux_losses` after it.
Memory: a sent activation's values are not needed by backward (only its autograd graph
is), so the executor keeps a scalar anchor into the graph instead of the output and drops
the output as soon as it is sent (Megatron frees it the same way, through private API); a
stage's stored input is released as soon as its backward has run.

Stage outputs are one tensor (GPT) or, for user models (`gigatron.pipe`), a tuple of
tensors: every floating-point tensor of it gets a grad back, the others (masks, positions)
only travel forward. A p2p that implements `KeyedPointToPoint` is told which stage boundary
each message crosses (`schedules.message_boundary`), so messages may differ in shape.

Split backward (zb-h1, zbv): a (micro-batch, chunk) with a `WeightGrad` in the schedule runs
its forward and its `Backward` (B) inside `wgrad.deferring` with its own queue, so the linear
layers leave their weight gradients to the queue, which the `WeightGrad` (W) runs. The V
placement (`placement="v"`) keeps the hand-off between a rank's two chunks local: chunk 0's
output is chunk 1's input on the last rank (detached there, so the grad comes back as a
received one would), and chunk 1's input grad is chunk 0's output grad.

`grad_sync` (optional, a `GradSync`) gets `enable_sync(chunk, enabled)` before every
backward and W, True only for that chunk's last one (its last micro-batch's W under a split
schedule: the step at which the last weight gradients arrive), so reductions overlap
backward; the caller waits for them (`grad_sync.finish_sync()`) after `run`, then steps its
optimizer.
"""
from __future__ import annotations

from typing import (Dict, List, Mapping, Optional, Protocol, Sequence, Tuple, Union, cast,
                    runtime_checkable)

import torch

from gigatron.parallel import timeline
from gigatron.parallel.tensor.wgrad import WeightGradQueue, deferring

from .interfaces import GradSync, MicroBatch, MicroBatchStep, Payload
from .schedules import (Backward, Communication, Forward, Instruction, RecvActivation,
                        RecvGrad, SendActivation, SendGrad, WeightGrad, comm_batches,
                        is_first_stage, is_last_stage, is_local, last_grad_step_per_chunk,
                        message_boundary, peer, virtual_stage)

MessageKey = Tuple[str, int]  # ("activation" or "grad", stage boundary)


@runtime_checkable
class KeyedPointToPoint(Protocol):
    """A p2p told which boundary each message crosses (messages of several shapes)."""

    def communicate_keyed(self, sends: Sequence[Tuple[Payload, int, MessageKey]],
                          recvs: Sequence[Tuple[int, MessageKey]]) -> List[Payload]:
        """Send (payload, global rank, key) triples and receive one payload per (global
        rank, key) in one batch."""
        ...


class PointToPoint(Protocol):
    """What the executor needs of the pipeline's p2p (PipelineP2P, or a timed wrapper)."""

    def communicate(self, sends: Sequence[Tuple[torch.Tensor, int]],
                    recv_from: Sequence[int]) -> List[torch.Tensor]:
        """Send (tensor, global rank) pairs, receive one tensor from each rank in one batch."""
        ...


def as_tensors(payload: Payload) -> Tuple[torch.Tensor, ...]:
    """A payload's tensors in order (one tensor is a payload of one)."""
    return payload if isinstance(payload, tuple) else (payload,)


def _float_tensors(payload: Payload) -> List[torch.Tensor]:
    return [t for t in as_tensors(payload) if t.is_floating_point()]


def _input_grads(hidden: Payload) -> Payload:
    """The grads to send back for a received stage input (zeros where backward left none):
    a tensor for a tensor, a tuple over the floating-point tensors for a tuple."""
    grads = tuple(t.grad if t.grad is not None else torch.zeros_like(t)
                  for t in _float_tensors(hidden))
    return grads if isinstance(hidden, tuple) else grads[0]


def _detached(payload: Payload) -> Payload:
    """The payload cut from its graph, as it would arrive from another rank."""
    tensors = tuple(t.detach() for t in as_tensors(payload))
    return tensors if isinstance(payload, tuple) else tensors[0]


class _OutputAnchor(torch.autograd.Function):
    """A scalar standing in for a sent stage output: its backward hands the output's
    floating-point tensors the grads received from the next stage, so the output itself
    need not be kept."""

    @staticmethod
    def forward(ctx, grad_holder: list, *outputs: torch.Tensor) -> torch.Tensor:
        ctx.grad_holder = grad_holder
        ctx.is_float = [t.is_floating_point() for t in outputs]
        return torch.zeros((), device=outputs[0].device)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        received = iter(as_tensors(ctx.grad_holder.pop()))
        return (None, *[next(received) if f else None for f in ctx.is_float])


class PipelineExecutor:
    """Runs schedules for this rank's model chunks (`chunks[c]` = virtual chunk c)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], p2p: PointToPoint, pp_rank: int,
                 pp_ranks: Sequence[int], grad_sync: Optional[GradSync] = None, *,
                 micro_batch_step: MicroBatchStep, placement: str = "loop") -> None:
        self.chunks = list(chunks)
        self.placement = placement  # "loop" or "v" (zbv): schedules.placement_of
        self.p2p = p2p
        self.pp_rank = pp_rank
        self.pp_ranks = list(pp_ranks)  # global rank of each pipeline stage
        self.grad_sync = grad_sync
        self.micro_batch_step = micro_batch_step
        self.peak_stored = 0  # most (micro-batch, chunk) activations alive at once: for tests
        # the last run's auxiliary and layer losses by name, summed over its micro-batches
        # (detached; this rank's chunks only)
        self.aux_losses: Dict[str, torch.Tensor] = {}

    @property
    def pp_size(self) -> int:
        return len(self.pp_ranks)

    def run(self, schedule: Sequence[Instruction], batches: Sequence[MicroBatch],
            loss_scale: float = 1.0,
            loss_divisor: Union[float, torch.Tensor, None] = None) -> List[torch.Tensor]:
        """Run one step's forwards, backwards and messages; returns the detached
        per-micro-batch losses (device tensors, last stage only). Backward starts from each
        loss x loss_scale / loss_divisor (default: the number of micro-batches).

        Grads accumulate into `.grad` or the grad sync's buffers (zero them before the
        step; finish the grad sync after it); `batches[mb]` is micro-batch mb as the
        micro-batch step reads it (ranks whose chunks never read it may pass anything).
        """
        self._check_inputs(schedule, batches)
        self._forward_only = not any(isinstance(i, Backward) for i in schedule)
        self._batches = batches
        self._scale = loss_scale / (len(batches) if loss_divisor is None else loss_divisor)
        self._last_grad_step = last_grad_step_per_chunk(schedule)
        split = {(i.microbatch, i.chunk) for i in schedule if isinstance(i, WeightGrad)}
        self._queues: Dict[tuple, WeightGradQueue] = {
            key: WeightGradQueue() for key in split if not self._forward_only}
        self._inputs: Dict[tuple, Optional[Payload]] = {}
        self._outputs: Dict[tuple, torch.Tensor] = {}  # loss, or anchor of a sent output
        self._to_send: Dict[tuple, Payload] = {}
        self._grad_holders: Dict[tuple, list] = {}
        # instruction type -> {(mb, chunk): tensor}
        self._received: Dict[type, Dict[tuple, Payload]] = {RecvActivation: {}, RecvGrad: {}}
        self._input_grads: Dict[tuple, Payload] = {}
        self._losses: Dict[int, torch.Tensor] = {}
        self.peak_stored = 0
        self.aux_losses = {}
        for step in comm_batches(schedule):
            if isinstance(step, tuple):
                self._communicate(step)
                continue
            start = timeline.now() if timeline.on else 0
            if isinstance(step, Forward):
                self._forward(step.microbatch, step.chunk)
            elif isinstance(step, Backward):
                self._backward(step)
            elif isinstance(step, WeightGrad):
                self._weight_grad(step)
            if timeline.on:
                self._record_span(step, start)
        leftover = (len(self._outputs) + len(self._input_grads) + len(self._to_send) +
                    len(self._queues) + sum(len(d) for d in self._received.values()))
        if leftover:
            raise RuntimeError(f"schedule left {leftover} tensors unconsumed: it is malformed")
        return [self._losses[mb] for mb in sorted(self._losses)]

    def _record_span(self, step: Instruction, start: int) -> None:
        """The timeline's span of a forward, backward (B when split) or weight-gradient step
        ('forward mb 3', 'chunk 1' when interleaved), with the virtual stage it ran."""
        kind = {Forward: "forward", Backward: "backward", WeightGrad: "weight grad"}[type(step)]
        chunk = f" chunk {step.chunk}" if len(self.chunks) > 1 else ""
        timeline.record(f"{kind} mb {step.microbatch}{chunk}", start, {
            "microbatch": step.microbatch, "chunk": step.chunk,
            "stage": virtual_stage(self.pp_rank, step.chunk, self.pp_size, self.placement)})

    def _check_inputs(self, schedule: Sequence[Instruction],
                      batches: Sequence[MicroBatch]) -> None:
        forwards = [i for i in schedule if isinstance(i, Forward)]
        microbatches = 1 + max((i.microbatch for i in forwards), default=-1)
        chunks = 1 + max((i.chunk for i in forwards), default=-1)
        if microbatches != len(batches):
            raise ValueError(f"the schedule runs {microbatches} micro-batches but "
                             f"{len(batches)} were given")
        if chunks != len(self.chunks):
            raise ValueError(f"the schedule runs {chunks} virtual chunks per stage but this "
                             f"rank has {len(self.chunks)} model chunks: build both from the "
                             f"same --num-layers-per-virtual-pipeline-stage")

    def _is_last(self, chunk: int) -> bool:
        return is_last_stage(self.pp_rank, chunk, self.pp_size, len(self.chunks),
                             self.placement)

    def _is_first(self, chunk: int) -> bool:
        return is_first_stage(self.pp_rank, chunk, self.pp_size, self.placement)

    def _local_peer(self, op: Communication) -> Optional[tuple]:
        """The (micro-batch, chunk) on this rank at the other end of `op`, when the placement
        keeps it local (the V's turn on the last rank); None: a real message."""
        if not is_local(op, self.pp_rank, self.pp_size, self.placement):
            return None
        return op.microbatch, peer(op, self.pp_rank, self.pp_size, self.placement)[1]

    def _forward(self, mb: int, chunk: int) -> None:
        batch, key, step = self._batches[mb], (mb, chunk), self.micro_batch_step
        hidden: Optional[Payload] = None
        if not self._is_first(chunk):
            hidden = self._received[RecvActivation].pop(key)
            for t in _float_tensors(hidden):
                t.requires_grad_(not self._forward_only)
        last = self._is_last(chunk)
        with torch.set_grad_enabled(not self._forward_only), deferring(self._queues.get(key)):
            output = self.chunks[chunk](**step.chunk_inputs(batch, hidden, last))
            extra = self._add_aux_losses(step.layer_losses(self.chunks[chunk]))
            if last:
                loss = step.loss(output, batch)
                self._losses[mb] = loss.loss.detach()
                aux = self._add_aux_losses(loss.aux_losses)
                output = loss.loss if aux is None else loss.loss + aux
        if not last:
            local = self._local_peer(SendActivation(mb, chunk))
            if local is None:
                self._to_send[key] = output
            else:  # a new leaf: chunk 1's backward leaves its grad there, as after a recv
                self._received[RecvActivation][local] = _detached(output)
        if not self._forward_only:
            self._inputs[key] = hidden
            if not last:
                self._grad_holders[key] = []
                output = _OutputAnchor.apply(self._grad_holders[key], *as_tensors(output))
            self._outputs[key] = output if extra is None else output + extra
        self.peak_stored = max(self.peak_stored, len(self._inputs.keys() | self._queues.keys()))

    def _add_aux_losses(self, losses: Mapping[str, torch.Tensor]) -> Optional[torch.Tensor]:
        """Report `losses` in `aux_losses`; their sum to back-propagate (None: there are none)."""
        total: Optional[torch.Tensor] = None
        for name, value in losses.items():
            seen = self.aux_losses.get(name)
            self.aux_losses[name] = value.detach() if seen is None else seen + value.detach()
            total = value if total is None else total + value
        return total

    def _enable_sync(self, step: Instruction) -> None:
        if self.grad_sync is not None:
            self.grad_sync.enable_sync(step.chunk, self._last_grad_step.get(step.chunk) == step)

    def _backward(self, step: Backward) -> None:
        """The full backward of (micro-batch, chunk), or its input-gradient part B when the
        schedule splits it (the weight gradients then wait in its queue for W)."""
        mb, chunk = key = step.microbatch, step.chunk
        self._enable_sync(step)
        # a sent output's anchor ignores the grad it gets: scaling it scales only the
        # layer losses added to it
        output, hidden = self._outputs.pop(key) * self._scale, self._inputs.pop(key)
        if not self._is_last(chunk):
            self._grad_holders.pop(key).append(self._received[RecvGrad].pop(key))
        if output.requires_grad:  # a stage whose output depends on nothing trainable: no-op
            with deferring(self._queues.get(key)):  # a recomputed forward defers too
                torch.autograd.backward(output)
        if not self._is_first(chunk):
            assert hidden is not None  # received from the previous stage
            local = self._local_peer(SendGrad(mb, chunk))
            if local is None:
                self._input_grads[key] = _input_grads(hidden)
            else:
                self._received[RecvGrad][local] = _input_grads(hidden)

    def _weight_grad(self, step: WeightGrad) -> None:
        """W: the weight gradients (mb, chunk)'s B deferred, accumulated as autograd would."""
        self._enable_sync(step)
        self._queues.pop((step.microbatch, step.chunk)).run()

    def _communicate(self, ops: tuple) -> None:
        sends, recvs, recv_from = [], [], []
        for op in ops:
            peer_rank, _ = peer(op, self.pp_rank, self.pp_size, self.placement)
            key = (op.microbatch, op.chunk)
            message = ("activation" if isinstance(op, (SendActivation, RecvActivation))
                       else "grad", message_boundary(op, self.pp_rank, self.pp_size,
                                                     self.placement))
            if isinstance(op, SendActivation):
                sends.append((self._to_send.pop(key), self.pp_ranks[peer_rank], message))
            elif isinstance(op, SendGrad):
                sends.append((self._input_grads.pop(key), self.pp_ranks[peer_rank], message))
            else:
                recvs.append((type(op), key))
                recv_from.append((self.pp_ranks[peer_rank], message))
        received: Sequence[Payload]
        if isinstance(self.p2p, KeyedPointToPoint):
            received = self.p2p.communicate_keyed(sends, recv_from)
        else:  # one fixed shape: every payload is one tensor
            received = self.p2p.communicate([(cast(torch.Tensor, t), r) for t, r, _ in sends],
                                            [r for r, _ in recv_from])
        for (kind, key), payload in zip(recvs, received):
            self._received[kind][key] = payload
