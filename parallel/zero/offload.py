"""ZeRO-Offload's step: grads stream to the host and updated weights back, bucket by bucket.

With offload_optimizer "cpu" (--optimizer-cpu-offload) the host holds this rank's fp32 master
shards and the optimizer state (Adam: m and v), 12 bytes per parameter, plus a fixed set of
reused buffers of `offload_bucket_size` elements: two fp32 buffers for gradients going down,
two in the parameters' dtype for updated weights going up (pinned when the parameters are on
a GPU). The step walks the master shards in buckets of that size:

    copy bucket k+1's grads down (copy stream)  |  step bucket k on the CPU, cast it into a
                                                |  weight buffer, copy it up (copy stream)

so the copies overlap the CPU Adam; with the model on the CPU the same order runs
synchronously. The global grad norm (clipping) and fp16's overflow check are computed on the
device before the stream (ZeroOptimizer.step, as DeepSpeed does), so no part of the step needs
every grad on the host at once.

The optimizer steps one bucket by taking it as its parameter: a slice of the master shard,
slices of its per-element state, copies of its scalars (Adam's step count advances once per
step). Only elementwise rules can be sliced (STREAMED); the others (Lamb's per-parameter
trust ratio, a user's own optimizer class) get the whole grad shard in one host buffer per
flat group, as before this module: 4 more host bytes per parameter.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from gigatron.parallel.zero.adam import UncorrectedAdam
from gigatron.parallel.zero.flat_group import FlatGroup

# elementwise update rules: stepping a slice of a shard equals stepping the whole shard
STREAMED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
            UncorrectedAdam)

Factor = Union[float, torch.Tensor]


class OffloadStep:
    """The offloaded optimizer step over `groups`' host master shards (see module doc)."""

    def __init__(self, groups: Sequence[FlatGroup], optimizer: torch.optim.Optimizer,
                 bucket_size: int) -> None:
        self.groups, self.optimizer = list(groups), optimizer
        self.streamed = type(optimizer) in STREAMED
        self.buckets: List[Tuple[FlatGroup, int, int]] = [
            (g, start, min(start + bucket_size, g.shard_numel)) for g in self.groups
            for start in range(0, g.shard_numel, bucket_size)] if self.streamed else []
        numel = max((end - start for _, start, end in self.buckets), default=0)
        device = self.groups[0].device
        pin = device.type == "cuda"  # pin_memory needs CUDA (and only helps copies to it)
        self.grad_buffers = [torch.empty(numel, dtype=torch.float32, pin_memory=pin)
                             for _ in range(2)]
        self.param_buffers = [torch.empty(numel, dtype=self.groups[0].dtype, pin_memory=pin)
                              for _ in range(2)]
        self._lanes = _Lanes(device)
        self._host_grads: Dict[int, torch.Tensor] = {}  # not streamed: a grad shard per group

    def host_bytes(self) -> Dict[str, int]:
        """Bytes of every host tensor the offloaded step owns, by kind."""
        state = sum(_nbytes(v) for g in self.groups
                    for v in self.optimizer.state.get(g.master, {}).values()
                    if isinstance(v, torch.Tensor))
        return {"master": sum(_nbytes(g.master) for g in self.groups), "optimizer_state": state,
                "buffers": sum(_nbytes(b) for b in self.grad_buffers + self.param_buffers),
                "grads": sum(_nbytes(b) for b in self._host_grads.values())}

    def step(self, factor: Factor) -> None:
        """Step every master shard with its grads times `factor` (unscaling and clipping: a
        float, or a 0-dim device tensor) and copy the updated weights into the parameters'
        shards on the device (stages 1-2 all-gather them afterwards)."""
        if isinstance(factor, torch.Tensor):
            factor = factor.cpu()  # the CPU needs the grads, so waiting for the norm is free
        if not self.streamed:
            self._step_whole(factor)
            return
        lanes, n = self._lanes, len(self.buckets)
        before = {id(g.master): _scalars(self.optimizer.state.get(g.master)) for g in self.groups}
        lanes.begin()
        self._copy_down(0)
        for k, (g, start, end) in enumerate(self.buckets):
            if k + 1 < n:
                self._copy_down(k + 1)
            lanes.wait(lanes.down_done[k % 2])
            grad = self.grad_buffers[k % 2][:end - start]
            if not (isinstance(factor, float) and factor == 1.0):
                grad.mul_(factor)
            self._step_slice(g, start, end, grad, before[id(g.master)])
            lanes.wait(lanes.up_done[k % 2])  # the weight buffer's previous copy is done
            weights = self.param_buffers[k % 2][:end - start]
            weights.copy_(g.master[start:end])
            with lanes.on(lanes.up):
                for piece, offset in _overlaps(_param_pieces(g), start, end):
                    piece.copy_(weights[offset:offset + piece.numel()], non_blocking=True)
                lanes.record(lanes.up_done[k % 2], lanes.up)
        lanes.end()

    def _copy_down(self, k: int) -> None:
        g, start, end = self.buckets[k]
        buffer, lanes = self.grad_buffers[k % 2], self._lanes
        with lanes.on(lanes.down):
            for piece, offset in _overlaps(g.grad_shard_pieces(), start, end):
                buffer[offset:offset + piece.numel()].copy_(piece, non_blocking=True)
            lanes.record(lanes.down_done[k % 2], lanes.down)

    def _step_slice(self, g: FlatGroup, start: int, end: int, grad: torch.Tensor,
                    before: Optional[Dict[str, Any]]) -> None:
        """Step master[start:end] alone: the optimizer sees it as the only parameter of its
        group, with slices of the shard's state (or, on the very first step, a fresh state
        it builds as it would for the whole shard, copied into full-size tensors here)."""
        master, state = g.master, self.optimizer.state
        view = master[start:end]
        full = state.get(master, {})
        own = {} if before is None else {
            **{k: v[start:end] for k, v in full.items() if _per_element(v, master)},
            **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in before.items()}}
        group = next(gr for gr in self.optimizer.param_groups
                     if any(p is master for p in gr["params"]))
        params, view.grad, state[view] = group["params"], grad, own
        group["params"] = [view]
        try:
            self.optimizer.step()
        finally:
            group["params"] = params
            own = state.pop(view)
            view.grad = None
        kept = state[master]
        for key, value in own.items():
            if not _per_element(value, view):
                kept[key] = value
                continue
            if key not in kept:
                kept[key] = torch.zeros_like(master)
            if kept[key][start:end].data_ptr() != value.data_ptr():
                kept[key][start:end].copy_(value)

    def _step_whole(self, factor: Factor) -> None:
        """Optimizers that are not elementwise: each grad shard whole in a host buffer kept
        across steps, one optimizer step, the weights written back from the masters."""
        for g in self.groups:
            host = self._host_grads.get(id(g))
            if host is None:
                host = torch.empty(g.shard_numel, dtype=torch.float32,
                                   pin_memory=g.device.type == "cuda")
                self._host_grads[id(g)] = host
            for piece, offset in _overlaps(g.grad_shard_pieces(), 0, g.shard_numel):
                host[offset:offset + piece.numel()].copy_(piece)
            if not (isinstance(factor, float) and factor == 1.0):
                host.mul_(factor)
            g.master.grad = host.view_as(g.master)
        self.optimizer.step()
        for g in self.groups:
            g.master.grad = None
            for piece, offset in _overlaps(_param_pieces(g), 0, g.shard_numel):
                piece.copy_(g.master[offset:offset + piece.numel()])


class _Lanes:
    """A copy stream each way and the events guarding the two buffers of each kind. On the
    CPU every copy has finished when it returns, so the lanes do nothing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        active = device.type != "cpu"
        self.down = torch.Stream(device=device) if active else None
        self.up = torch.Stream(device=device) if active else None
        self.down_done = [torch.Event(device=device) if active else None for _ in range(2)]
        self.up_done = [torch.Event(device=device) if active else None for _ in range(2)]

    def begin(self) -> None:
        """The copies start after everything queued so far (backward, reductions, norm)."""
        if self.down is not None and self.up is not None:
            current = torch.accelerator.current_stream(self.device)
            self.down.wait_stream(current)
            self.up.wait_stream(current)

    def end(self) -> None:
        """Later work (the all-gathers, zero_grad) waits for both copy streams."""
        if self.down is not None and self.up is not None:
            current = torch.accelerator.current_stream(self.device)
            current.wait_stream(self.down)
            current.wait_stream(self.up)

    def on(self, stream: Optional[torch.Stream]) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if stream is None else stream

    def record(self, event: Optional[torch.Event], stream: Optional[torch.Stream]) -> None:
        if event is not None:
            event.record(stream)

    def wait(self, event: Optional[torch.Event]) -> None:
        """The host waits for the copy `event` marks (one never recorded is done)."""
        if event is not None:
            event.synchronize()


def _overlaps(pieces: Sequence[torch.Tensor], start: int, end: int
              ) -> Iterator[Tuple[torch.Tensor, int]]:
    """The parts of consecutive flat `pieces` that fall in [start, end) of their
    concatenation, each with its offset from `start`."""
    offset = 0
    for piece in pieces:
        n = piece.numel()
        lo, hi = max(start, offset), min(end, offset + n)
        if lo < hi:
            yield piece.reshape(-1)[lo - offset:hi - offset], lo - start
        offset += n


def _param_pieces(g: FlatGroup) -> List[torch.Tensor]:
    """This rank's parameter shard on the device, laid out like the master shard."""
    return [g.param_shard_piece(b) for b in g.buckets]


def _per_element(value: Any, like: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == like.shape


def _scalars(state: Optional[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """A shard's state other than its per-element tensors (Adam's step) before this step;
    None before its first step."""
    if not state:
        return None
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()
            if not isinstance(v, torch.Tensor) or v.dim() == 0}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
