"""One virtual pipeline stage of a `PipelineModule`: a run of consecutive layers.

The executor calls a stage through `PipeModuleStep` (`input_ids=` on the first stage, else
`hidden_states=`): the stage passes its input through its layers in order, each layer
getting the previous layer's output as its one argument (a tensor, or a tuple of tensors
for several), as DeepSpeed's PipelineModule does.

With `seed_layers`, every layer's forward first seeds the random generators with
`base_seed * (micro-batch count + 1) + layer index` (DeepSpeed's formula), so dropout
draws the same masks whatever the layout; the count is kept per stage, which sees the
micro-batches in order. `activation_checkpoint_interval` k > 0 recomputes each run of k
layers in backward (only runs with parameters, or of `checkpointable_layers` classes).

Layers are looked up by name when they run, so a module swapped in after construction
(tensor parallelism's `parallelize` on the PipelineModule) is the one that runs, once the
PipelineModule has handed it to its stages (`PipelineModule.chunks` does).
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import nn

from gigatron.engine.pipe.specs import set_random_seed


class PipelineStage(nn.Module):
    """This rank's layers parts[s]..parts[s+1]-1 of a PipelineModule (virtual stage s)."""

    def __init__(self, stage: int, layers: Sequence[Tuple[int, str, Any]],
                 modules: Dict[str, nn.Module], tied: Dict[str, nn.Module],
                 seed_layers: bool = False, seed_fn: Optional[Callable[[int], Any]] = None,
                 base_seed: int = 1234, checkpoint_interval: int = 0,
                 checkpoint_func: Optional[Callable[..., Any]] = None,
                 checkpointable_layers: Optional[List[str]] = None) -> None:
        super().__init__()
        self.stage = stage
        for name, module in modules.items():  # global layer indices: layout-free names
            self.add_module(name, module)
        self.tied_modules = nn.ModuleDict(tied)
        # (global layer index, kind, what): ("module", name), ("tied", (key, forward_fn))
        # or ("function", callable), in order
        self.layers = list(layers)
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.checkpoint_interval = checkpoint_interval
        self.checkpoint_func = checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.micro_offset = 0  # forward calls so far (DeepSpeed's micro_offset)

    @property
    def layer_indices(self) -> List[int]:
        return [index for index, _, _ in self.layers]

    def layer_function(self, position: int) -> Callable[..., Any]:
        """What the stage's `position`-th layer calls (looked up now: modules may have been
        swapped since construction)."""
        _, kind, what = self.layers[position]
        if kind == "module":
            return self._modules[what]  # type: ignore[return-value]
        if kind == "tied":
            key, forward_fn = what
            module = self.tied_modules[key]
            return module if forward_fn is None else functools.partial(forward_fn, module)
        return what

    def forward(self, input_ids: Any = None, hidden_states: Any = None) -> Any:
        """The stage's output for its input (`input_ids` on the first stage, else
        `hidden_states`)."""
        x = input_ids if hidden_states is None else hidden_states
        self.micro_offset += 1
        offset = self.micro_offset + 1
        step = self.checkpoint_interval or len(self.layers)
        for start in range(0, len(self.layers), step):
            run = self._runner(start, min(start + step, len(self.layers)), offset)
            if self.checkpoint_interval and self._checkpointable(start, start + step):
                assert self.checkpoint_func is not None
                x = self.checkpoint_func(run, *(x if isinstance(x, tuple) else (x,)))
            else:
                x = run(x)
        return x

    def _runner(self, start: int, stop: int, offset: int) -> Callable[..., Any]:
        """Layers start..stop-1 as one function of the unpacked input (checkpoint's form)."""
        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for position in range(start, stop):
                if self.seed_layers:
                    index = self.layers[position][0]
                    (self.seed_fn or set_random_seed)(self.base_seed * offset + index)
                x = self.layer_function(position)(x)
                if isinstance(x, list):
                    x = tuple(x)
            return x
        return run

    def _checkpointable(self, start: int, stop: int) -> bool:
        """DeepSpeed's rule: the listed classes only, else any run holding parameters."""
        funcs = [self.layer_function(p) for p in range(start, min(stop, len(self.layers)))]
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters())
                   for f in funcs)
