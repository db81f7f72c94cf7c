"""Pipeline parallelism: layer partitioning, schedules as data, p2p, the one executor.

A training step on one rank:

    partition = partition_layers(num_layers, pp, num_layers_per_virtual_stage=...)
    chunks = ...  # this rank's model chunks (a GPT: gigatron.models.pipeline_chunks)
    step = ...    # how the model's chunks read a micro-batch and compute its loss (a
                  # MicroBatchStep; a GPT: gigatron.models.pipeline_chunks.GPTMicroBatchStep)
    p2p = PipelineP2P(p2p_tensor_shape(seq_length, micro_batch_size, hidden_size, tp_size,
                                       sequence_parallel), params_dtype, device, groups.pp)
    executor = PipelineExecutor(chunks, p2p, pp_rank, groups.ranks("pp"), grad_sync,
                                micro_batch_step=step)
    losses = executor.run(build_schedule(pp_rank, pp, num_microbatches,
                                         partition.virtual_chunks), micro_batches)
    grad_sync.finish_sync()   # then the optimizer step: the executor owns no optimizer

Users' own models (`gigatron.pipe.PipelineModule`, DeepSpeed's API) run through the same
executor: `engine/pipe/partition_method.py` cuts their layer lists DeepSpeed's way, and `shaped_p2p.py`
carries stage outputs of any shapes (learnt by a handshake before the first step).

`gigatron schedule --pp 4 --num-microbatches 8` draws a schedule
(`simulate.py` checks one across all ranks; both are pure, import them from their modules).
"""
from gigatron.parallel.pipeline.executor import PipelineExecutor
from gigatron.parallel.pipeline.interfaces import GradSync, MicroBatchStep, StageLoss
from gigatron.parallel.pipeline.p2p import PipelineP2P, p2p_tensor_shape
from gigatron.parallel.pipeline.partition import (PipelinePartition, partition_layers,
                                                  stage_layer_counts)
from gigatron.parallel.pipeline.schedules import (build_schedule, check_num_microbatches,
                                                  interleaved_one_f_one_b, no_pipelining,
                                                  one_f_one_b)

__all__ = [
    "PipelineExecutor", "GradSync", "MicroBatchStep", "StageLoss",
    "PipelineP2P", "p2p_tensor_shape", "PipelinePartition", "partition_layers",
    "stage_layer_counts", "build_schedule", "check_num_microbatches",
    "interleaved_one_f_one_b", "no_pipelining", "one_f_one_b",
]
