"""Build this pipeline rank's GPT model chunks (one GPTModel per virtual chunk).

Lives with the model, not in parallel/pipeline/: the pipeline knows only the pure layer
partition (parallel/pipeline/partition.py), never GPT.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.parallel.tensor import TensorParallelRNGTracker, model_parallel_seed, tp_rank
from gigatron.parallel.tensor.random import MODEL_PARALLEL_RNG
from gigatron.parallel.comm import Group


def build_model_chunks(config: TransformerConfig, partition: PipelinePartition, pp_rank: int,
                       tp_group: Group = None, seed: int = 1234, device: Optional[torch.device] = None
                       ) -> List[torch.nn.Module]:
    """`chunks[c]` holds the layers of virtual stage (c, pp_rank); embedding on the first
    virtual stage, final norm + output layer on the last. Name-seeded init makes every
    layout hold the same full model, tied output weight included.

    The chunks share one tensor-parallel RNG tracker seeded as Megatron does
    (seed + 100 * pp_rank, then per tp rank), so no two chunks or stages draw the same
    dropout masks."""
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
                     rng_tracker=tracker)
            for c in range(partition.virtual_chunks)]
