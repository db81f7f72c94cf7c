"""ZeRO stage 3: parameters live as dp shards and are gathered per layer just in time.

A *unit* is one child of an nn.ModuleList / nn.Sequential / nn.ModuleDict (a transformer
layer: GPTModel keeps its layers in a ModuleDict keyed by global layer number); the
parameters not inside any such child (embeddings, final norm, output layer, tied weights)
form the root unit, gathered for the model's whole forward and again for its backward.
A unit is all-gathered before its forward (the next unit's gather is prefetched), freed
after it, gathered again when the gradient of its output arrives in backward (prefetching
the unit whose backward comes next), and freed once all its parameters have gradients.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Dict, Iterator, List, Set, Tuple

import torch
from torch import nn

from gigatron.parallel import comm
from gigatron.parallel.comm import Group

if TYPE_CHECKING:
    from gigatron.parallel.zero.flat_group import FlatGroup

LAYER_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def find_units(model: nn.Module) -> List[Tuple[nn.Module, List[nn.Parameter]]]:
    """Split the trainable parameters into gather units: layer-list children, then the root."""
    units: List[Tuple[nn.Module, List[nn.Parameter]]] = []
    seen: Set[int] = set()

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, LAYER_CONTAINERS):
                for layer in child.children():
                    params = [p for p in layer.parameters() if p.requires_grad and
                              id(p) not in seen]
                    seen.update(id(p) for p in params)
                    if params:
                        units.append((layer, params))
            else:
                visit(child)

    if isinstance(model, LAYER_CONTAINERS):
        visit(nn.ModuleDict({"layers": model}))
    else:
        visit(model)
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
    if rest:
        units.append((model, rest))
    return units


class _Unit:
    def __init__(self, module: nn.Module, params: List[nn.Parameter]) -> None:
        self.module, self.params = module, params
        self.pieces: list = []  # (FlatGroup, Bucket) whose params belong to this unit
        self.state = "free"     # free | inflight | ready
        self.handles: list = []
        self.grads_left = len(params)


class ParamGatherer:
    """Installs the module and tensor hooks that gather and free stage-3 parameters."""

    def __init__(self, units: List[Tuple[nn.Module, List[nn.Parameter]]], flat_groups: List["FlatGroup"],
                 dp_group: Group, prefetch: bool = True) -> None:
        self.dp_group, self.prefetch = dp_group, prefetch
        self.units = [_Unit(m, ps) for m, ps in units]
        owner = {id(p): u for u in self.units for p in u.params}
        for g in flat_groups:
            for b in g.buckets:
                unit = owner[id(g.params[b.param_indices[0]])]
                unit.pieces.append((g, b))
        self._owner: Dict[int, _Unit] = owner
        self._order: List[_Unit] = []  # forward execution order, recorded on first use
        self._hooks = []
        for u in self.units:
            self._hooks.append(u.module.register_forward_pre_hook(
                lambda m, args, u=u: self._before_forward(u)))
            self._hooks.append(u.module.register_forward_hook(
                lambda m, args, out, u=u: self._after_forward(u, out)))

    def _gather(self, u: _Unit) -> None:
        if u.state != "free":
            return
        for g, b in u.pieces:
            b.param_full.untyped_storage().resize_(b.param_full.numel() *
                                                  b.param_full.element_size())
            u.handles.append(comm.all_gather(b.param_full, g.param_shard_piece(b),
                                             group=g.dp_group, async_op=True))
        u.state = "inflight"

    def _ensure(self, u: _Unit) -> None:
        self._gather(u)
        for h in u.handles:
            h.wait()
        u.handles.clear()
        u.state = "ready"

    def _free(self, u: _Unit) -> None:
        if u.state == "free":
            return
        self._ensure(u)
        for _, b in u.pieces:
            b.param_full.untyped_storage().resize_(0)
        u.state = "free"

    def _neighbour(self, u: _Unit, step: int):
        if not self.prefetch or u not in self._order:
            return None
        i = self._order.index(u) + step
        return self._order[i] if 0 <= i < len(self._order) else None

    def _before_forward(self, u: _Unit) -> None:
        if u not in self._order:
            self._order.append(u)
        self._ensure(u)
        nxt = self._neighbour(u, +1)
        # The next unit's backward has already run when this forward is a recomputation.
        if nxt is not None and not _in_backward():
            self._gather(nxt)

    def _after_forward(self, u: _Unit, out) -> None:
        if _in_backward():  # a recomputation: its backward reads the parameters next
            return  # (on_param_grad frees them)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, u=u: self._before_backward(u))
        self._free(u)

    def _before_backward(self, u: _Unit) -> None:
        self._ensure(u)
        prev = self._neighbour(u, -1)
        if prev is not None and prev.grads_left > 0:
            self._gather(prev)

    def on_param_grad(self, p: nn.Parameter) -> None:
        """Free a unit once every one of its parameters has its gradient."""
        u = self._owner[id(p)]
        u.grads_left -= 1
        if u.grads_left == 0:
            self._free(u)
            u.grads_left = len(u.params)

    def release_all(self) -> None:
        """Free every unit (end of a step; also resets the per-backward counters)."""
        for u in self.units:
            self._free(u)
            u.grads_left = len(u.params)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Hold all parameters gathered (checkpoint saving, inspection)."""
        for u in self.units:
            self._ensure(u)
        try:
            yield
        finally:
            self.release_all()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (a forward now is activation
    recomputation)."""
    return torch._C._current_graph_task_id() != -1


def _tensors(out) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
