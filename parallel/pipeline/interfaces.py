"""The contracts the pipeline executor runs through: the model's `MicroBatchStep` and the
gradient sync (`GradSync`).

`MicroBatchStep` is all the executor knows of a model: it never reads a batch key or
computes a loss itself. For each micro-batch it asks the model how to call a chunk
(the first stage reads the micro-batch, the others take the received activation),
what the last stage's loss is (a `StageLoss`: the loss it logs, plus named auxiliary
losses it back-propagates but reports apart), and which losses the chunk's layers added
during that forward (a router's load-balancing loss, on whichever stage the layer is).
Megatron-Core splits it alike (`forward_step_func` returns the output and a `loss_func`;
MoE layers attach their loss to the activations); here the model answers three typed
questions and the executor does the scaling and backward of every loss itself.

`GradSync` is what the pipeline executor calls before every backward and what the training
loop finishes after the schedule; ZeroOptimizer implements it with bucketed, overlapped
reductions (over dp, the embedding group for the tied word embedding, and tp for the
sequence-parallel parameters' grads).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Protocol, Tuple, Union, runtime_checkable

import torch


@runtime_checkable
class GradSync(Protocol):
    """Gradient reduction across data (and embedding, sequence-parallel) groups."""

    def enable_sync(self, chunk: int, enabled: bool) -> None:
        """Before each backward: may chunk's grads be reduced during it (its last
        micro-batch) or only accumulated?"""
        ...

    def finish_sync(self) -> None:
        """After the step's last backward: every reduction done, grads ready to step."""
        ...


Payload = Union[torch.Tensor, Tuple[torch.Tensor, ...]]  # a stage output or its grads
MicroBatch = Any  # one micro-batch as the data loader gave it: only the model's step reads it


@dataclass(frozen=True)
class StageLoss:
    """One micro-batch's loss, computed by the model from the last stage's output."""

    loss: torch.Tensor  # scalar: back-propagated and returned by `run` (the logged loss)
    # scalars back-propagated with `loss` but reported apart, by name (not part of `loss`)
    aux_losses: Mapping[str, torch.Tensor] = field(default_factory=dict)


class MicroBatchStep(Protocol):
    """What the executor asks of the model for each micro-batch (the executor knows no
    batch keys and no loss)."""

    def chunk_inputs(self, batch: MicroBatch, received: Optional[Payload],
                     last: bool) -> Dict[str, Any]:
        """Keyword arguments of a model chunk's forward: the first stage (`received` is None)
        reads the micro-batch, the others take the previous stage's output; `last`: the
        output goes on to `loss`."""
        ...

    def loss(self, output: Any, batch: MicroBatch) -> StageLoss:
        """The last stage's loss of the micro-batch, from the chunk's output."""
        ...

    def layer_losses(self, chunk: torch.nn.Module) -> Mapping[str, torch.Tensor]:
        """The scalar losses `chunk`'s layers added during the forward that just ran, by
        name, taken (the next forward starts with none): the executor back-propagates them
        on this stage, scaled as the micro-batch loss, and reports them as `StageLoss`'s
        auxiliary losses."""
        ...
