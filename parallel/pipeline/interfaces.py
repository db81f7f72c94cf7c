"""The contracts the pipeline executor runs through: the model's `MicroBatchStep` and the
gradient sync (`GradSync`), with its plain implementation.

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
reductions. `AllReduceGradSync` implements it without overlap: at `finish_sync` it all-reduces, in three phases every rank runs in the same order
(so no two groups wait on each other):
1. grads of params marked `sequence_parallel` over tp (each tp rank saw only its sequence
   slice; the model marks them only when sequence parallelism is on);
2. grads of `shared_embedding` params over the embedding group (the tied word embedding on
   the first stage and its copy as output weight on the last must take the same step);
3. every grad over dp, averaged.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import (Any, Dict, Iterable, List, Mapping, Optional, Protocol, Tuple, Union,
                    runtime_checkable)

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.tensor.utils import allreduce_sequence_parallel_grads


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


def _all_reduce_flat(grads: List[torch.Tensor], group, average: bool) -> None:
    if not grads or comm.group_size(group) == 1:
        return
    dtypes = sorted({g.dtype for g in grads}, key=str)
    if len(dtypes) > 1:  # one flat buffer per dtype, in the same order on every rank
        for dtype in dtypes:
            _all_reduce_flat([g for g in grads if g.dtype == dtype], group, average)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    if average:
        flat /= comm.group_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class AllReduceGradSync:
    """Reduce grads of `params` over dp (average), the embedding group and tp (SP params)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dp_group: Group = None,
                 embedding_group: Group = None, tp_group: Group = None) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.dp_group = dp_group
        self.embedding_group = embedding_group
        self.tp_group = tp_group
        self.enabled_calls: List[tuple] = []  # (chunk, enabled) per backward: for tests

    def enable_sync(self, chunk: int, enabled: bool) -> None:
        """Nothing overlaps here; remember the calls so tests can check the executor."""
        self.enabled_calls.append((chunk, enabled))

    def finish_sync(self) -> None:
        """Run the three reductions; every param gets a grad (zeros if backward left None)."""
        grads: List[torch.Tensor] = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        allreduce_sequence_parallel_grads(self.params, self.tp_group)
        shared = [g for p, g in zip(self.params, grads) if getattr(p, "shared_embedding", False)]
        _all_reduce_flat(shared, self.embedding_group, average=False)
        _all_reduce_flat(grads, self.dp_group, average=True)
