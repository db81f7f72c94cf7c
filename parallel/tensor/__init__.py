"""Tensor slicing: column/row-parallel linear, vocab-parallel embedding and cross-entropy,
the (sequence-parallel) communication mappings, the TP-aware RNG tracker, and
`parallelize(model, plan, groups)` for splitting any model by a plan (ready-made plans for GPT-2, Llama and gigatron's GPT: gigatron.models.tensor_plans).

Process groups come in as arguments; `tp_group=None` means no tensor parallelism.
"""
from gigatron.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from gigatron.parallel.tensor.init import InitSpec, initialize_parameter, name_seed
from gigatron.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from gigatron.parallel.tensor.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
    tp_rank,
    tp_size,
)
from gigatron.parallel.tensor.parallelize import TensorParallelPlan, parallelize
from gigatron.parallel.tensor.random import (
    TensorParallelRNGTracker,
    checkpoint,
    model_parallel_seed,
)
from gigatron.parallel.tensor.styles import (
    ColumnParallel,
    LocalAttributes,
    Replicate,
    RowParallel,
    SequenceParallelNorm,
    Style,
    VocabParallel,
)
from gigatron.parallel.tensor.utils import (
    allreduce_sequence_parallel_grads,
    divide,
    gather_full_parameter,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
    "vocab_parallel_cross_entropy", "InitSpec", "initialize_parameter", "name_seed",
    "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region",
    "scatter_to_tensor_parallel_region", "gather_from_tensor_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "tp_rank", "tp_size",
    "TensorParallelRNGTracker", "checkpoint", "model_parallel_seed",
    "allreduce_sequence_parallel_grads", "divide", "gather_full_parameter",
    "parallelize", "TensorParallelPlan", "Style", "ColumnParallel", "RowParallel",
    "VocabParallel", "SequenceParallelNorm", "Replicate", "LocalAttributes",
]
