"""This pipeline rank's GPT model chunks (one GPTModel per virtual chunk), and how the
pipeline executor runs them on a micro-batch (`GPTMicroBatchStep`).

Lives with the model, not in parallel/pipeline/: the pipeline knows only the pure layer
partition (parallel/pipeline/partition.py) and the `MicroBatchStep` contract, never GPT.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.documents import CU_SEQLENS
from gigatron.models.gpt import GPTModel
from gigatron.models.losses import (GPTMicroBatch, LayerLosses, masked_mean_loss,
                                    masked_sum_loss)
from gigatron.parallel.pipeline.interfaces import Payload, StageLoss
from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.parallel.tensor import TensorParallelRNGTracker, model_parallel_seed, tp_rank
from gigatron.parallel.tensor.random import MODEL_PARALLEL_RNG
from gigatron.parallel.comm import Group


def build_model_chunks(config: TransformerConfig, partition: PipelinePartition, pp_rank: int,
                       tp_group: Group = None, seed: int = 1234, device: Optional[torch.device] = None,
                       dispatcher_factory: Optional[Callable] = None, cp_group: Group = None,
                       cp_comm_type: str = "p2p") -> List[torch.nn.Module]:
    """`chunks[c]` holds the layers of virtual stage (c, pp_rank); embedding on the first
    virtual stage, final norm + output layer on the last. Name-seeded init makes every
    layout hold the same full model, tied output weight included.

    The chunks share one tensor-parallel RNG tracker seeded as Megatron does
    (seed + 100 * pp_rank, then per tp rank), so no two chunks or stages draw the same
    dropout masks. `dispatcher_factory`: the MoE layers' token dispatcher (expert
    parallelism; default every expert on this rank); `cp_group`, `cp_comm_type`: context
    parallelism (GPTModel's)."""
    if partition.layers and sum(len(r) for rs in partition.layers for r in rs) \
            != config.num_layers:
        raise ValueError(f"the pipeline partition covers "
                         f"{sum(len(r) for rs in partition.layers for r in rs)} layers but "
                         f"--num-layers is {config.num_layers}")
    tracker = TensorParallelRNGTracker()
    tracker.add(MODEL_PARALLEL_RNG, model_parallel_seed(seed + 100 * pp_rank, tp_rank(tp_group)))
    return [GPTModel(config, tp_group=tp_group, pre_process=partition.pre_process(pp_rank, c),
                     post_process=partition.post_process(pp_rank, c),
                     layer_range=partition.layer_range(pp_rank, c), seed=seed, device=device,
                     rng_tracker=tracker, dispatcher_factory=dispatcher_factory,
                     cp_group=cp_group, cp_comm_type=cp_comm_type)
            for c in range(partition.virtual_chunks)]


class GPTMicroBatchStep:
    """The executor's `MicroBatchStep` for GPT chunks, on Megatron's micro-batches:
    `input_ids` (+ `position_ids`) for the first stage, `labels` (+ `loss_mask`) for the
    last, whose chunk returns the per-token loss; the micro-batch loss is its masked mean,
    or its masked sum with `per_token_loss` (--calculate-per-token-loss)."""

    def __init__(self, per_token_loss: bool = False, mtp: bool = False,
                 mtp_loss_scaling_factor: float = 0.1) -> None:
        """`mtp`: the model has multi-token prediction (its last stage reads the input ids
        too and its output stacks the depths' per-token losses), weighted by
        `mtp_loss_scaling_factor` (--mtp-loss-scaling-factor)."""
        self._per_token_loss = per_token_loss
        self._reduce = masked_sum_loss if per_token_loss else masked_mean_loss
        self._mtp, self._mtp_scale = mtp, mtp_loss_scaling_factor

    def chunk_inputs(self, batch: GPTMicroBatch, received: Optional[Payload],
                     last: bool) -> Dict[str, Any]:
        """GPTModel.forward's arguments: token ids (first stage) or hidden states, labels
        on the last stage (its output is then the per-token loss), positions and packed
        documents' `cu_seqlens` wherever the micro-batch has them."""
        kwargs: Dict[str, Any] = {}
        if received is None:
            kwargs["input_ids"] = batch["input_ids"]
        else:
            kwargs["hidden_states"] = received
        # every stage: positions restarting per document (RoPE) and the documents themselves
        for key in ("position_ids", CU_SEQLENS):
            if batch.get(key) is not None:
                kwargs[key] = batch[key]
        if last and batch.get("labels") is not None:
            kwargs["labels"] = batch["labels"]
            if self._mtp and received is not None:
                kwargs["input_ids"] = batch["input_ids"]  # multi-token prediction's
        return kwargs

    def loss(self, output: torch.Tensor, batch: GPTMicroBatch) -> StageLoss:
        """The per-token loss reduced over the micro-batch's loss mask; with multi-token
        prediction (output [1 + D, b, s]) its depths' losses too, back-propagated scaled
        and reported apart (models/mtp/loss.py)."""
        if output.dim() == 2:
            return StageLoss(self._reduce(output, batch))
        from gigatron.models.mtp.loss import mtp_losses

        return StageLoss(self._reduce(output[0], batch),
                         mtp_losses(output[1:], batch, self._mtp_scale, self._per_token_loss))

    def layer_losses(self, chunk: torch.nn.Module) -> Mapping[str, torch.Tensor]:
        """What the chunk's layers left in its `LayerLosses` during the forward."""
        losses: LayerLosses = getattr(chunk, "layer_losses")  # a GPTModel's, or a wrapper's
        return losses.take()
