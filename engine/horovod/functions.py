"""Horovod's start-of-training helpers: make every rank begin from root_rank's model and
optimizer (`broadcast_parameters`, `broadcast_optimizer_state`), and move Python objects
between ranks (`broadcast_object`, `allgather_object`).

`broadcast_optimizer_state` sends root_rank's whole state (tensors by broadcast, the rest
pickled) and loads it on the other ranks. Horovod instead first runs a step with zero
gradients when the state is empty, which moves parameters under weight decay and counts an
Adam step; here a fresh optimizer stays fresh, and the ranks end up identical either way.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import torch

from gigatron.engine.horovod.basics import rank
from gigatron.engine.horovod.ops import allgather, broadcast_, broadcast_async_, synchronize
from gigatron.engine.horovod.process_sets import global_process_set
from gigatron.parallel.world import current_device

try:  # Horovod pickles with cloudpickle (lambdas, local classes); plain pickle otherwise
    import cloudpickle as _pickler  # type: ignore[import-untyped]
except ImportError:  # pragma: no cover - cloudpickle is optional
    _pickler = pickle  # type: ignore[no-redef]

Params = Union[Mapping[str, torch.Tensor], Iterable[Union[torch.Tensor, Tuple[str, torch.Tensor]]]]


def broadcast_parameters(params: Params, root_rank: int) -> None:
    """Overwrite the tensors on every rank with root_rank's: a `model.state_dict()`, or a list
    of parameters or of (name, parameter) pairs such as `model.named_parameters()`."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)} (give a state_dict or a "
                         f"list of parameters)")
    handles = [broadcast_async_(p, root_rank, name) for name, p in items]
    for handle in handles:
        synchronize(handle)


@dataclass(frozen=True)
class _TensorSpec:
    """A tensor of root_rank's optimizer state, described for the other ranks."""

    shape: Tuple[int, ...]
    dtype: torch.dtype
    on_cpu: bool


def _skeleton(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _TensorSpec(tuple(x.shape), x.dtype, x.device.type == "cpu")
    if isinstance(x, dict):
        return {k: _skeleton(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_skeleton(v) for v in x)
    return x


def _materialize(x: Any) -> Any:
    if isinstance(x, _TensorSpec):
        device = torch.device("cpu") if x.on_cpu else current_device()
        return torch.empty(x.shape, dtype=x.dtype, device=device)
    if isinstance(x, dict):
        return {k: _materialize(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_materialize(v) for v in x)
    return x


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: Optional[torch.nn.Module] = None) -> None:
    """Give every rank root_rank's optimizer state and hyperparameters (lr, momentum, ...);
    `model` is accepted for Horovod's signature (sparse parameters need no special case).
    A fresh optimizer's trainable parameters are left with zero gradients where they had
    none, as after Horovod's zero-gradient step (code reading `p.grad` sees a tensor)."""
    if not optimizer.state:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    state = optimizer.state_dict()
    skeleton = broadcast_object(_skeleton(state) if rank() == root_rank else None, root_rank,
                                name="optimizer_state")
    if rank() != root_rank:
        state = _materialize(skeleton)
    handles = [broadcast_async_(t, root_rank) for t in _tensors(state)]
    for handle in handles:
        synchronize(handle)
    if rank() != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> Any:
    """root_rank's `obj` on every member of the process set (pickled, sent as bytes);
    root_rank gets `obj` back."""
    if rank() == root_rank:
        payload = torch.frombuffer(bytearray(_pickler.dumps(obj)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, f"{name}.length" if name else None, process_set)
    if rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, name, process_set)
    return obj if rank() == root_rank else pickle.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: Any = global_process_set) -> List[Any]:
    """Every member's `obj`, in rank order (pickled, gathered as bytes); named after the
    object's type by default, as Horovod."""
    name = type(obj).__name__ if name is None else name
    payload = torch.frombuffer(bytearray(_pickler.dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([payload.numel()]), f"{name}.sizes" if name else None,
                      process_set)
    joined = allgather(payload, name, process_set)
    return [pickle.loads(part.numpy().tobytes())
            for part in torch.split(joined, sizes.tolist())]
