"""How the pipeline executor runs a PipelineModule's stages on DeepSpeed's micro-batches.

The engine turns each (inputs, labels) pair into {"input_ids": inputs, "labels": labels}
(each end of the pipeline keeps only its part); the first stage's layers get the inputs,
the others the previous stage's output, and the last stage's output goes with the labels
to the module's `loss_fn(outputs, labels)` (DeepSpeed's), or is the loss itself when there
is none.
DeepSpeed's layers add no losses of their own: an extra loss travels in a layer's outputs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional

import torch

from gigatron.parallel.pipeline.interfaces import MicroBatch, Payload, StageLoss

if TYPE_CHECKING:
    from gigatron.engine.pipe.module import PipelineModule


class PipeModuleStep:
    """The executor's `MicroBatchStep` for a PipelineModule (its `loss_fn` is read at each
    call, as DeepSpeed's engine does)."""

    def __init__(self, module: "PipelineModule") -> None:
        self.module = module

    def chunk_inputs(self, batch: MicroBatch, received: Optional[Payload],
                     last: bool) -> Dict[str, Any]:
        """A PipelineStage's arguments: the micro-batch's inputs on the first stage, else
        the received activation."""
        if received is None:
            return {"input_ids": batch["input_ids"]}
        return {"hidden_states": received}

    def loss(self, output: Any, batch: MicroBatch) -> StageLoss:
        """DeepSpeed's: loss_fn(outputs, labels), or the last layer's output itself."""
        loss_fn = self.module.loss_fn
        loss = output if loss_fn is None else loss_fn(output, batch.get("labels"))
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            what = f"shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else \
                type(loss).__name__
            source = "loss_fn(outputs, labels)" if loss_fn is not None else \
                "the last layer (no loss_fn was given)"
            raise ValueError(f"{source} must return a scalar loss tensor, got {what}")
        return StageLoss(loss.reshape(()))

    def layer_losses(self, chunk: torch.nn.Module) -> Mapping[str, torch.Tensor]:
        """None: DeepSpeed's PipelineModule layers have no side channel for losses."""
        return {}
