"""--torch-compile: each transformer layer and the loss compiled with torch.compile.

As torchtitan's `compile` does per TransformerBlock: every layer of every model chunk is
compiled on its own (`nn.Module.compile`, in place: parameter names, hooks, checkpoints and
the pipeline executor see the same modules), and so is the chunk's loss function (the
vocab-parallel cross entropy on the last stage). Tensor-parallel mappings, context-parallel
attention, FP8 and recomputation trace into one graph per layer (the collectives become
torch's functional collectives inside a trace, parallel/comm.py); an MoE layer's dispatch,
experts and combine run uncompiled (their token counts are data: models/moe/layer.py).

The compile time printed once is what dynamo and inductor record in
`torch._dynamo.utils.compilation_time_metrics` (tracing, graph lowering and code
generation, forward and backward graphs) by the end of the first step: the first step's
extra time, without the run's own work in it.
"""
from __future__ import annotations

from typing import List, Optional

import torch

# --torch-compile's default on CUDA: flip to True once a GPU measurement shows compiled
# layers faster (issue 42, "Speed on the chip"); on the CPU it stays off (inductor compiles
# C++ for minutes on a small machine)
COMPILE_BY_DEFAULT_ON_CUDA = False

# what compiles the layers: torch.compile's own default (tests trace with "aot_eager")
BACKEND = "inductor"

# the entries of compilation_time_metrics that time a whole compile (others nest in them)
_TOTALS = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")


def compile_wanted(setting: Optional[bool], device: torch.device) -> bool:
    """Whether a run compiles: --torch-compile / --no-torch-compile, else the device's
    default (off on the CPU; COMPILE_BY_DEFAULT_ON_CUDA on CUDA)."""
    if setting is not None:
        return setting
    return torch.device(device).type == "cuda" and COMPILE_BY_DEFAULT_ON_CUDA


def compile_model_chunks(chunks: List[torch.nn.Module], backend: Optional[str] = None) -> int:
    """Compile each transformer layer of the GPT `chunks` (and a last stage's loss) in
    place with `backend` (default BACKEND); returns the number of layers compiled."""
    from gigatron.models.moe.layer import MoELayer
    from gigatron.parallel.tensor import vocab_parallel_cross_entropy

    backend = BACKEND if backend is None else backend
    compiled = 0
    for chunk in chunks:
        decoder: torch.nn.Module = getattr(chunk, "decoder")
        for module in decoder.modules():
            if isinstance(module, MoELayer):  # its token counts are data: left eager
                setattr(module, "_experts", torch.compiler.disable(module._experts))
        for layer in getattr(decoder, "layers").values():
            layer.compile(backend=backend)
            compiled += 1
        if getattr(chunk, "post_process", False):
            setattr(chunk, "cross_entropy",
                    torch.compile(vocab_parallel_cross_entropy, backend=backend))
    return compiled


def compile_seconds() -> float:
    """Seconds dynamo and inductor have spent compiling in this process so far."""
    from torch._dynamo.utils import compilation_time_metrics

    return sum(sum(compilation_time_metrics.get(name, ())) for name in _TOTALS)


class CompileTimeNote:
    """The one line saying how long compiling took: `after_step` gives it once, after the
    first step that compiled anything (None before and after)."""

    def __init__(self, enabled: bool) -> None:
        self.pending = enabled
        self.before = compile_seconds() if enabled else 0.0

    def after_step(self) -> Optional[str]:
        if not self.pending:
            return None
        seconds = compile_seconds() - self.before
        if seconds <= 0:
            return None
        self.pending = False
        return (f"torch.compile: compiled the transformer layers and the loss in "
                f"{seconds:.1f} s (dynamo + inductor, during the first step)")
