"""Point-to-point for pipelines whose stages pass differently shaped messages (user models).

A GPT's stages all pass one hidden-state shape known from the config (`p2p.PipelineP2P`).
A user model's stage may output any tensor or tuple of tensors, of any shapes and dtypes,
different at every stage boundary. As in DeepSpeed they must stay the same across
micro-batches and steps. The shapes are learnt by a shape handshake before the first step
(`discover_shapes`): one micro-batch walks through the virtual stages in pipeline order,
each stage running forward once (no grad, generators and buffers untouched) and sending
the next stage a header (dtype and shape of each tensor) followed by the tensors. Being
strictly sequential, the handshake cannot deadlock whatever the schedule. Afterwards every
message is a plain batched isend/irecv into buffers allocated from the learnt spec: an
activation has its boundary's spec, its grad the spec of the floating-point tensors of it.
"""
from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group

from .executor import MessageKey, Payload, as_tensors
from .schedules import stage_position

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
           torch.complex128)


@dataclass(frozen=True)
class PayloadSpec:
    """Shapes and dtypes of a stage output; `is_tuple`: a tuple (even of one) or a tensor."""

    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[torch.dtype, ...]
    is_tuple: bool

    @classmethod
    def of(cls, payload: Payload, what: str = "a pipeline stage's output") -> "PayloadSpec":
        """The spec of a payload; a ValueError if it is not a tensor or tuple of tensors."""
        tensors = as_tensors(payload)
        if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            got = type(payload).__name__ if not isinstance(payload, tuple) else \
                "(" + ", ".join(type(t).__name__ for t in payload) + ")"
            raise ValueError(f"{what} must be a tensor or a non-empty tuple of tensors (the "
                             f"only values that travel between stages, as in DeepSpeed), got "
                             f"{got}")
        return cls(tuple(tuple(t.shape) for t in tensors), tuple(t.dtype for t in tensors),
                   isinstance(payload, tuple))

    def grad_spec(self) -> "PayloadSpec":
        """What travels back: one grad per floating-point tensor."""
        kept = [(s, d) for s, d in zip(self.shapes, self.dtypes) if d.is_floating_point]
        return PayloadSpec(tuple(s for s, _ in kept), tuple(d for _, d in kept), self.is_tuple)

    def empty(self, device: torch.device) -> Payload:
        """Receive buffers for one message of this spec."""
        tensors = tuple(torch.empty(s, dtype=d, device=device)
                        for s, d in zip(self.shapes, self.dtypes))
        return tensors if self.is_tuple else tensors[0]

    def describe(self) -> str:
        parts = [f"{list(s)} {str(d).replace('torch.', '')}"
                 for s, d in zip(self.shapes, self.dtypes)]
        return f"({', '.join(parts)})" if self.is_tuple else parts[0]

    def encode(self, device: torch.device) -> torch.Tensor:
        """[is_tuple, count, (dtype code, ndim, *shape) per tensor] as int64."""
        values = [int(self.is_tuple), len(self.shapes)]
        for shape, dtype in zip(self.shapes, self.dtypes):
            if dtype not in _DTYPES:
                raise ValueError(f"a pipeline stage output of dtype {dtype} cannot be sent "
                                 f"between stages: use one of {', '.join(map(str, _DTYPES))}")
            values += [_DTYPES.index(dtype), len(shape), *shape]
        return torch.tensor(values, dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, header: torch.Tensor) -> "PayloadSpec":
        values = header.tolist()
        is_tuple, count, at = bool(values[0]), values[1], 2
        shapes, dtypes = [], []
        for _ in range(count):
            dtype, ndim = _DTYPES[values[at]], values[at + 1]
            shapes.append(tuple(values[at + 2:at + 2 + ndim]))
            dtypes.append(dtype)
            at += 2 + ndim
        return cls(tuple(shapes), tuple(dtypes), is_tuple)


class ShapedP2P:
    """Batched p2p of payloads whose spec per stage boundary was learnt by the handshake."""

    def __init__(self, device: torch.device, pp_group: Group = None, rank: int = 0) -> None:
        self.device, self.pp_group, self.rank = torch.device(device), pp_group, rank
        self.specs: Dict[int, PayloadSpec] = {}  # stage boundary -> activation spec
        self._to_self: Dict[MessageKey, Deque[Payload]] = defaultdict(deque)

    def spec(self, key: MessageKey) -> PayloadSpec:
        kind, boundary = key
        if boundary not in self.specs:
            raise RuntimeError(f"no shape is known for pipeline stage boundary {boundary}: "
                               f"discover_shapes must run before the first step")
        spec = self.specs[boundary]
        return spec if kind == "activation" else spec.grad_spec()

    def communicate(self, sends: Sequence[Tuple[torch.Tensor, int]],
                    recv_from: Sequence[int]) -> List[torch.Tensor]:
        """Only keyed messages: each needs its boundary to know its shapes."""
        raise TypeError("ShapedP2P carries keyed messages only: use communicate_keyed")

    def communicate_keyed(self, sends: Sequence[Tuple[Payload, int, MessageKey]],
                          recvs: Sequence[Tuple[int, MessageKey]]) -> List[Payload]:
        """Post every send and receive of one schedule batch together; wait; return the
        received payloads in the order of `recvs`."""
        remote_sends = []
        for payload, peer, key in sends:
            self._check(payload, key)
            tensors = tuple(t.detach().contiguous() for t in as_tensors(payload))
            if peer == self.rank:
                self._to_self[key].append(tensors if isinstance(payload, tuple) else tensors[0])
            else:
                remote_sends += [(t, peer) for t in tensors]
        received: List[Payload] = []
        remote_recvs = []
        for peer, key in recvs:
            if peer == self.rank:
                if not self._to_self[key]:
                    raise RuntimeError("schedule receives from itself before sending")
                received.append(self._to_self[key].popleft())
                continue
            payload = self.spec(key).empty(self.device)
            received.append(payload)
            remote_recvs += [(t, peer) for t in as_tensors(payload)]
        for request in comm.send_recv(remote_sends, remote_recvs, group=self.pp_group):
            request.wait()
        return received

    def _check(self, payload: Payload, key: MessageKey) -> None:
        kind, boundary = key
        what = f"the {kind} at pipeline stage boundary {boundary}"
        actual, expected = PayloadSpec.of(payload, what), self.spec(key)
        if actual != expected:
            raise ValueError(
                f"{what} is {actual.describe()}, but the first step's was "
                f"{expected.describe()}: tensors passed between pipeline stages must keep "
                f"their shapes and dtypes across micro-batches and steps (as in DeepSpeed); "
                f"pad the inputs to one shape, or call engine.reset_activation_shape()")

    # -- the handshake ------------------------------------------------------------------------
    def send_payload(self, payload: Payload, peer: int) -> None:
        """Header length, header, then the tensors (blocking: the handshake's order)."""
        header = PayloadSpec.of(payload).encode(self.device)
        length = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
        for tensor in (length, header, *as_tensors(payload)):
            self._wait(comm.send_recv([(tensor.detach().contiguous(), peer)], [],
                                      group=self.pp_group))

    def recv_payload(self, peer: int) -> Payload:
        length = torch.empty(1, dtype=torch.int64, device=self.device)
        self._wait(comm.send_recv([], [(length, peer)], group=self.pp_group))
        header = torch.empty(int(length.item()), dtype=torch.int64, device=self.device)
        self._wait(comm.send_recv([], [(header, peer)], group=self.pp_group))
        payload = PayloadSpec.decode(header).empty(self.device)
        for tensor in as_tensors(payload):
            self._wait(comm.send_recv([], [(tensor, peer)], group=self.pp_group))
        return payload

    @staticmethod
    def _wait(requests: List) -> None:
        for request in requests:
            request.wait()


def discover_shapes(p2p: ShapedP2P, run_stage: Callable[[int, Payload], Payload],
                    first_input: Optional[Payload], pp_rank: int, pp_ranks: Sequence[int],
                    num_chunks: int, placement: str = "loop") -> Dict[int, PayloadSpec]:
    """The shape handshake: virtual stages 0, 1, ... run forward in turn on one micro-batch
    (`run_stage(chunk, input)`; `first_input` on the first stage) and pass their output on;
    fills and returns `p2p.specs` for the boundaries this rank sends or receives across
    (`placement`: where the stages sit, schedules.placement_of)."""
    pp_size = len(pp_ranks)
    held: Optional[Payload] = first_input
    for stage in range(num_chunks * pp_size - 1):
        owner, chunk = stage_position(stage, pp_size, placement)
        receiver = stage_position(stage + 1, pp_size, placement)[0]
        if owner == pp_rank:
            assert held is not None, "the handshake reached a stage without its input"
            output = run_stage(chunk, held)
            p2p.specs[stage] = PayloadSpec.of(output, f"pipeline stage {stage}'s output")
            held = output
            if receiver != pp_rank:
                p2p.send_payload(output, pp_ranks[receiver])
        elif receiver == pp_rank:
            held = p2p.recv_payload(pp_ranks[owner])
            p2p.specs[stage] = PayloadSpec.of(held)
    return p2p.specs
