"""What a `PipelineModule` is made of: DeepSpeed's `LayerSpec` and `TiedLayerSpec`, and the
checks and facts about a list of layers that partitioning needs.

A layer is an nn.Module (built already, on every rank), a `LayerSpec` (built only by the
stage that runs it), a `TiedLayerSpec` (one module per stage, shared by every layer with
the same key; its `tied_weight_attr` parameters are kept equal across stages) or a plain
callable such as `lambda x: x.float()` (no parameters).
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import numpy as np
import torch
from torch import nn


class LayerSpec:
    """A layer to build later: `LayerSpec(nn.Linear, 16, 32, bias=False)` builds
    `nn.Linear(16, 32, bias=False)` on the stage that runs it, and nowhere else."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs an nn.Module class (DeepSpeed's rule), got "
                            f"{typename!r}: pass the class itself, e.g. LayerSpec(nn.Linear, "
                            f"16, 32), or put a plain function directly in the layers list")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def __repr__(self) -> str:
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log: bool = False) -> nn.Module:
        """The module this spec describes (a new one on every call)."""
        if log:
            print(f"[gigatron] building {self!r}", flush=True)
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer sharing its module with every other layer of the same `key` (tied input and
    output embeddings). On one stage the layers share one module; across stages each stage
    builds its own and the `tied_weight_attr` parameters (a name or a list; dotted names
    reach into submodules) start equal and get the sum of the stages' gradients. With
    `forward_fn`, the layer computes `forward_fn(module, inputs)` instead of
    `module(inputs)` (e.g. the output projection through the embedding's weight)."""

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Optional[Callable[..., Any]] = None,
                 tied_weight_attr: Union[str, Sequence[str]] = "weight",
                 **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"TiedLayerSpec key {key!r} must be a string usable as a Python "
                             f"name (it names the module in tied_modules), e.g. 'embed'")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = ([tied_weight_attr] if isinstance(tied_weight_attr, str)
                                 else list(tied_weight_attr))


def check_layers(layers: Any) -> List[Any]:
    """The layers as a list, or one ValueError naming the first layer that cannot be one."""
    try:
        items = list(layers)
    except TypeError:
        raise ValueError(f"PipelineModule(layers=...) needs a list (or nn.Sequential) of "
                         f"layers, got {type(layers).__name__}") from None
    if not items:
        raise ValueError("PipelineModule(layers=[]) has no layers to partition")
    for i, layer in enumerate(items):
        if type(layer).__name__ == "PipelineModule":
            raise ValueError(f"layers[{i}] is a PipelineModule: nesting them is not supported "
                             f"(nor in DeepSpeed); list its layers instead")
        if not isinstance(layer, (nn.Module, LayerSpec)) and not callable(layer):
            raise ValueError(f"layers[{i}] is a {type(layer).__name__} ({layer!r:.60}), which "
                             f"is neither an nn.Module, a LayerSpec/TiedLayerSpec nor a "
                             f"callable: every layer must be one of these")
    return items


def type_name(layer: Any) -> Optional[str]:
    """The class name "type:<regex>" partitioning matches (None: a callable without one)."""
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def display_name(layer: Any) -> str:
    """How the partition printout names a layer."""
    if isinstance(layer, TiedLayerSpec):
        return f"{layer.typename.__name__} (tied {layer.key!r})"
    return type_name(layer) or repr(layer)


@contextlib.contextmanager
def preserved_rng(device: Optional[torch.device] = None) -> Iterator[None]:
    """Run a block without moving any random number generator: Python's, NumPy's, torch's
    CPU one and `device`'s (a dry run must not change what training draws)."""
    python, numpy = random.getstate(), np.random.get_state()
    accelerators = [] if device is None or device.type == "cpu" else [device.index or 0]
    kwargs = {} if not accelerators else {"device_type": device.type}  # type: ignore[union-attr]
    try:
        with torch.random.fork_rng(devices=accelerators, **kwargs):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def trainable_parameter_count(layer: Any) -> int:
    """A layer's trainable parameter count; a LayerSpec is built on the meta device (no
    memory, no random numbers drawn), or for real if its constructor refuses meta."""
    if isinstance(layer, LayerSpec):
        with preserved_rng():
            try:
                with torch.device("meta"):
                    module = layer.build()
            except Exception:  # a constructor that reads data: build it (one layer's memory)
                module = layer.build()
    elif isinstance(layer, nn.Module):
        module = layer
    else:
        return 0
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def set_random_seed(seed: int) -> None:
    """DeepSpeed's default seed function for seed_layers: Python, NumPy and torch (every
    device)."""
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
