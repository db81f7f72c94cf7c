"""Horovod's DistributedOptimizer: the user's optimizer whose gradients are all-reduced as
backward produces them.

Horovod's design: `DistributedOptimizer(opt, ...)` returns an instance of a class made on the
fly from a mixin and `type(opt)`, so `isinstance(result, type(opt))` holds and `step()` is
the user's step after `synchronize()`. The result shares `opt`'s param groups (and here also
its state and defaults, which Horovod drops).

Tensor fusion: the parameters are packed, in reverse registration order (about the order
backward produces their gradients), into buckets of at most HOROVOD_FUSION_THRESHOLD bytes
(Horovod's variable and default, 128 MiB; 0: one tensor per bucket) and one dtype. A
post-accumulate-grad hook per parameter counts the gradients in; a bucket whose gradients
are all in is compressed, concatenated and all-reduced asynchronously while backward goes on.
Buckets launch strictly in bucket order, so every rank issues the same sequence of
collectives even when its gradients arrive in another order; each is a named allreduce
(`allreduce.<its first parameter's name>`) negotiated with one round at launch, so a rank
that has called `hvd.join()` adds zeros to it. `synchronize()` launches what
is left (a parameter backward did not reach sends zeros, as in Horovod), waits, scales and
writes the results into `p.grad`. With `backward_passes_per_step=k` a parameter's gradient
is reduced after its k-th backward only (local accumulation in between).
"""
from __future__ import annotations

import contextlib
import math
import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from gigatron.engine.horovod import process_sets
from gigatron.engine.horovod.basics import Average, HorovodReduceOp, Sum, comm_device
from gigatron.engine.horovod.process_sets import ProcessSet, global_process_set
from gigatron.engine.horovod.compression import Compression, Compressor
from gigatron.engine.horovod.exchange import sparse_allreduce_async
from gigatron.engine.horovod.ops import allreduce_async_, resolve_op, scale_, synchronize
from gigatron.parallel import timeline

DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024  # bytes: Horovod's default fusion buffer
Groups = Union[None, int, Sequence[Sequence[torch.Tensor]]]


def fusion_threshold(env: Optional[Mapping[str, str]] = None) -> int:
    """Bytes per fused all-reduce: HOROVOD_FUSION_THRESHOLD, else Horovod's 128 MiB."""
    value = (os.environ if env is None else env).get("HOROVOD_FUSION_THRESHOLD")
    if value is None:
        return DEFAULT_FUSION_THRESHOLD
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={value!r} is not a number of bytes") from None


def plan_buckets(params: Sequence[torch.Tensor], threshold_bytes: int,
                 groups: Groups = None) -> List[List[int]]:
    """Indices into `params` per bucket, in launch order. Without `groups`: consecutive
    parameters of one dtype and device up to `threshold_bytes` (a larger one alone); `groups`
    as Horovod's: a count of contiguous near-equal groups, or lists of tensors (the rest alone)."""
    if isinstance(groups, int) and not isinstance(groups, bool) and groups > 0:
        bounds = [round(i * len(params) / groups) for i in range(groups + 1)]
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a]
    if groups is not None and not isinstance(groups, int):
        return _explicit_groups(params, groups)
    buckets: List[List[int]] = []
    used, kind = 0, None
    for i, p in enumerate(params):
        nbytes = p.numel() * p.element_size()
        if not buckets or (p.dtype, p.device) != kind or used + nbytes > threshold_bytes:
            buckets.append([])
            used, kind = 0, (p.dtype, p.device)
        buckets[-1].append(i)
        used += nbytes
    return buckets


def _explicit_groups(params: Sequence[torch.Tensor],
                     groups: Sequence[Sequence[torch.Tensor]]) -> List[List[int]]:
    index = {id(p): i for i, p in enumerate(params)}
    seen: set = set()
    buckets = []
    for group in groups:
        for p in group:
            if not isinstance(p, torch.Tensor):
                raise ValueError("groups must consist of torch.Tensor.")
            if id(p) in seen:
                raise ValueError("A parameter can only appear once in groups.")
            seen.add(id(p))
        members = [index[id(p)] for p in group if id(p) in index]
        if members:
            buckets.append(members)
    grouped = {i for b in buckets for i in b}
    return buckets + [[i] for i in range(len(params)) if i not in grouped]


def _parameter_names(named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
                     param_groups: List[Dict[str, Any]]) -> Dict[torch.Tensor, str]:
    """Horovod's checks: (name, parameter) tuples, unique names, every parameter named."""
    if named_parameters is None:
        return {p: f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups)
                for j, p in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not isinstance(x, tuple) for x in named):
        raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                         "usually model.named_parameters().")
    names = [n for n, _ in named]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique; duplicates: "
                         f"{', '.join(dups)}")
    given = {id(p) for _, p in named}
    unnamed = [p for g in param_groups for p in g["params"] if id(p) not in given]
    if unnamed:
        raise ValueError(f"named_parameters was given but {len(unnamed)} optimizer "
                         f"parameter(s) are not in it (shapes "
                         f"{[tuple(p.shape) for p in unnamed][:5]})")
    return {p: n for n, p in named}


@dataclass
class _Bucket:
    """Parameters reduced together, and this step's state of their reduction."""

    params: List[torch.Tensor]
    ready: int = 0  # parameters whose gradient is complete for this step
    inflight: Optional[Tuple[Any, Optional[torch.Tensor], List[Any]]] = field(default=None,
                                                                             repr=False)


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed in before the user's optimizer class by `DistributedOptimizer`."""

    def __init__(self, params: List[Dict[str, Any]],
                 named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]],
                 compression: type[Compressor], backward_passes_per_step: int,
                 op: HorovodReduceOp,
                 gradient_predivide_factor: float, groups: Groups,
                 sparse_as_dense: bool, process_set: ProcessSet) -> None:
        # the next class in the MRO is the user's optimizer: built from the shared param
        # groups, which carry every hyperparameter
        super().__init__(params)  # type: ignore[call-arg]
        self._names = _parameter_names(named_parameters, self.param_groups)
        self._parameter_names = self._names  # Horovod's name, read by users' code
        self.process_set = process_set
        self._compression, self.op = compression, op
        self.backward_passes_per_step = backward_passes_per_step
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self._should_synchronize, self._synchronized = True, False
        self._params = [p for g in self.param_groups for p in g["params"]
                        if p.requires_grad][::-1]
        self._buckets: List[_Bucket] = []
        self._hooks: List[Any] = []
        # as Horovod: a set of one reduces nothing, a rank outside the set keeps its own
        if process_set.included() and (process_set.size() or 1) > 1:
            self._register_hooks(groups)
        self._reset()

    def _register_hooks(self, groups: Groups) -> None:
        plan = plan_buckets(self._params, fusion_threshold(), groups)
        self._buckets = [_Bucket([self._params[i] for i in idx]) for idx in plan]
        for bucket in self._buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    partial(self._on_grad, bucket)))

    def _reset(self) -> None:
        self._delay = {p: self.backward_passes_per_step for p in self._params}
        for b in self._buckets:
            b.ready = 0
        self._next = 0  # the next bucket to launch
        self._pending = False  # a gradient arrived since the last synchronize

    def _on_grad(self, bucket: _Bucket, p: torch.Tensor) -> None:
        if self._delay[p] <= 0:
            raise AssertionError(
                "Gradients were computed more than backward_passes_per_step times before "
                "step(): increase backward_passes_per_step to accumulate gradients locally.")
        self._delay[p] -= 1
        self._pending = True
        if self._delay[p] == 0:
            bucket.ready += 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and \
                self._buckets[self._next].ready == len(self._buckets[self._next].params):
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket: _Bucket) -> None:
        """Compress the bucket's gradients into one buffer and start its all-reduce."""
        entries: List[Tuple[torch.Tensor, Any, Any]] = []
        wires = []
        for p in bucket.params:
            if p.grad is not None and p.grad.is_sparse and not self.sparse_as_dense:
                entries.append((p, None, sparse_allreduce_async(
                    p.grad, f"allreduce.{self._names.get(p)}", self.op, self.process_set)))
                continue
            wire, ctx = self._compression.compress(self._dense_grad(p))
            entries.append((p, wire.shape, ctx))
            wires.append(wire.reshape(-1))
        dtypes = sorted({str(w.dtype) for w in wires})
        if len(dtypes) > 1:
            raise TypeError(f"the compressor gave several dtypes ({', '.join(dtypes)}) for "
                            f"gradients of one dtype; it must give one")
        if not wires:
            bucket.inflight = (None, None, entries)
            return
        with torch.no_grad():
            flat = torch.cat(wires).to(comm_device())
            if self.op == Average:
                scale_(flat, 1.0 / self.gradient_predivide_factor)
        # negotiated like any hvd.allreduce, so a rank in hvd.join() adds zeros; one round
        # right away (every active rank launches its buckets at the same points) starts it
        # while backward goes on
        wire_op = Sum if self.op == Average else self.op
        handle = allreduce_async_(flat, name=f"allreduce.{self._names.get(bucket.params[0])}",
                                  op=wire_op, process_set=self.process_set)
        self.process_set.controller().run_round()
        bucket.inflight = (handle, flat, entries)

    def _dense_grad(self, p: torch.Tensor) -> torch.Tensor:
        if p.grad is None:  # backward did not reach p here; another rank's may have
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            grad = grad.to_dense()
        return grad.detach()

    def _finish(self, bucket: _Bucket) -> None:
        """Wait for the bucket's all-reduce; write the averaged gradients into p.grad."""
        if bucket.inflight is None:
            return
        handle, flat, entries = bucket.inflight
        bucket.inflight = None
        if handle is not None:
            synchronize(handle)
        with torch.no_grad():
            if flat is not None and self.op == Average:
                scale_(flat, self.gradient_predivide_factor, self.process_set.size() or 1)
            offset = 0
            for p, shape, ctx in entries:
                if shape is None:  # a sparse gradient, gathered (Horovod's sparse path)
                    p.grad = ctx()
                    continue
                assert flat is not None  # a dense entry has its place in the buffer
                n = math.prod(shape)
                reduced = self._compression.decompress(flat[offset:offset + n].view(shape), ctx)
                offset += n
                if p.grad.is_sparse:
                    p.grad.zero_().add_(reduced.to(p.grad.device).to_sparse())
                else:
                    p.grad.copy_(reduced.view_as(p.grad))

    def synchronize(self) -> None:
        """Finish every gradient all-reduce (launching what backward left); p.grad then
        holds the reduced gradients (call before clipping or unscaling them)."""
        with timeline.span("gradient reduction"):
            for bucket in self._buckets[self._next:]:
                bucket.ready = len(bucket.params)
            self._launch_ready()
            for bucket in self._buckets:
                self._finish(bucket)
        self._reset()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Make step() skip synchronize(), after an explicit optimizer.synchronize()."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """synchronize() (unless inside skip_synchronize()), then the optimizer's step."""
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() "
                              "after optimizer.synchronize(): the gradients are reduced twice. "
                              "Wrap step() in `with optimizer.skip_synchronize():`.")
            self.synchronize()
        self._synchronized = False
        with timeline.span("optimizer step"):
            return super().step() if closure is None else super().step(closure)

    # torch wraps an optimizer class's step once to run step hooks; the user's class step
    # already does, so hooks run once, after synchronize().
    step.hooked = True  # type: ignore[attr-defined]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad; refused between backward and step/synchronize."""
        if self._pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before "
                "optimizer.step() or optimizer.synchronize(): the gradients being reduced "
                "would be lost. With gradient accumulation use backward_passes_per_step.")
        super().zero_grad(set_to_none)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The optimizer's load_state_dict; reductions in flight are finished and dropped."""
        for bucket in self._buckets:
            if bucket.inflight is not None:
                if bucket.inflight[0] is not None:
                    synchronize(bucket.inflight[0])
                bucket.inflight = None
        self._reset()
        super().load_state_dict(state_dict)

    def set_backward_passes_per_step(self, passes: int) -> None:
        """Change how many backward passes are accumulated locally before each reduction."""
        if passes <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = passes
        self._reset()


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Optional[Iterable[Tuple[str, torch.Tensor]]] = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: Groups = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set) -> torch.optim.Optimizer:
    """Horovod's DistributedOptimizer: `optimizer`'s class, with gradients averaged (op=Sum:
    summed) over the process set's ranks during backward; step() waits for them. With op=Average,
    gradient_predivide_factor f scales by 1/f before the sum and f/size after it."""
    process_set = process_sets.resolve(process_set)
    op = resolve_op(op)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if num_groups != 0:
        warnings.warn("num_groups is deprecated, use groups=", DeprecationWarning, stacklevel=2)
        groups = num_groups if groups is None else groups
    if backward_passes_per_step <= 0:
        raise ValueError("backward_passes_per_step must be > 0")
    if isinstance(groups, int) and groups < 0 or not isinstance(groups, (int, list, type(None))):
        raise ValueError("groups should be a non-negative integer or a list of lists of "
                         "torch.Tensor.")
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("this optimizer is already a hvd.DistributedOptimizer")
    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped = cls(optimizer.param_groups, named_parameters, compression,
                  backward_passes_per_step, op, gradient_predivide_factor, groups,
                  sparse_as_dense, process_set)
    wrapped.state, wrapped.defaults = optimizer.state, optimizer.defaults
    return wrapped
