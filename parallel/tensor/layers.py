"""Tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Weights are created empty (on `device`, possibly meta) and tagged with an `InitSpec`; the
model fills them afterwards from name-seeded full tensors (see `init.py`), so a layer
never needs to know its own parameter name. `tp_group=None` means no tensor parallelism.
The linears' `fp8` (None: off) holds their FP8 state when `fp8.enable_fp8` gave
them one (Megatron's --fp8-format on the transformer layers). Inside `wgrad.deferring` the
linears defer their weight gradients to the zero-bubble schedules' W step (not under FP8);
biases, the embedding and everything else compute theirs in the input-gradient backward.
Their `tp_comm_overlap` (None: off; a `TPCommOverlap` from `async_tp.enable_tp_comm_overlap`,
Megatron's --tp-comm-overlap) pipelines the sequence-parallel all-gather / reduce-scatter
with the GEMM in chunks (async_tp.py); it needs sequence parallelism and is not run with FP8.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.parallel.tensor.async_tp import (TPCommOverlap, all_gather_linear,
                                               check_overlap, linear_reduce_scatter)
from gigatron.parallel.tensor.fp8 import FP8LinearState, fp8_linear
from gigatron.parallel.tensor.init import InitSpec, Stride, set_parallel_attributes
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
from gigatron.parallel.tensor.utils import divide
from gigatron.parallel.tensor.wgrad import deferrable_linear
from gigatron.parallel.comm import Group


def _empty(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device))


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split by output rows: each rank computes its slice of Y.

    Under sequence parallelism the input arrives split along the sequence (dim 0) and is
    all-gathered here (its grad reduce-scattered back). `partition_stride` > 1 marks an
    output made of stacked blocks each split across tp (SwiGLU's gate and up); a tuple gives
    the full sizes of unequal blocks (a fused q, k, v with fewer key/value heads).
    """

    weight: Optional[nn.Parameter]
    bias: Optional[nn.Parameter]
    fp8: Optional[FP8LinearState]
    tp_comm_overlap: Optional[TPCommOverlap]

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group = None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False,
                 init_std: float = 0.02, skip_weight_param: bool = False,
                 partition_stride: Stride = 1, valid_rows: Optional[int] = None,
                 params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.fp8 = None
        self.tp_comm_overlap = None
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp_size(tp_group) > 1
        self.output_size_per_partition = divide(output_size, tp_size(tp_group),
                                                "output size across tensor-parallel ranks")
        shape = (self.output_size_per_partition, input_size)
        if skip_weight_param:
            self.weight = None
        else:
            self.weight = _empty(shape, params_dtype, device)
            set_parallel_attributes(self.weight, InitSpec("normal", (output_size, input_size),
                                                          init_std, valid_rows),
                                    partition_dim=0, stride=partition_stride)
        if bias:
            self.bias = _empty((self.output_size_per_partition,), params_dtype, device)
            set_parallel_attributes(self.bias, InitSpec("zeros", (output_size,)),
                                    partition_dim=0, stride=partition_stride)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x: [s(/tp), b, in] -> [s, b, out/tp] (or the full out with gather_output)."""
        weight = self.weight if weight is None else weight
        if weight is None:
            raise ValueError("ColumnParallelLinear built with skip_weight_param needs the "
                             "weight passed to forward (tied output layer)")
        if self.tp_comm_overlap is not None:
            check_overlap(self)
            y = all_gather_linear(x, weight, self.bias, self.tp_group, self.tp_comm_overlap)
            return gather_from_tensor_parallel_region(y, self.tp_group) if self.gather_output \
                else y
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        if self.fp8 is None:
            y = deferrable_linear(x, weight, self.bias)
        else:
            y = fp8_linear(x, weight, self.bias, self.fp8)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split by input columns: partial sums are reduced over tp.

    The reduction is an all-reduce, or a reduce-scatter along the sequence under sequence
    parallelism. The bias is replicated and added after the reduction.
    """

    weight: nn.Parameter
    bias: Optional[nn.Parameter]
    fp8: Optional[FP8LinearState]
    tp_comm_overlap: Optional[TPCommOverlap]

    def __init__(self, input_size: int, output_size: int, *, tp_group: Group = None, bias: bool = True,
                 input_is_parallel: bool = True, sequence_parallel: bool = False,
                 init_std: float = 0.02, params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.fp8 = None
        self.tp_comm_overlap = None
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and tp_size(tp_group) > 1
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel")
        in_per_partition = divide(input_size, tp_size(tp_group),
                                  "input size across tensor-parallel ranks")
        self.weight = _empty((output_size, in_per_partition), params_dtype, device)
        set_parallel_attributes(self.weight, InitSpec("normal", (output_size, input_size),
                                                      init_std), partition_dim=1)
        if bias:
            self.bias = _empty((output_size,), params_dtype, device)
            set_parallel_attributes(self.bias, InitSpec("zeros", (output_size,)),
                                    sequence_parallel=self.sequence_parallel)
        else:
            self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, in/tp] -> [s(/tp), b, out]."""
        if not self.input_is_parallel:
            x = scatter_to_tensor_parallel_region(x, self.tp_group)
        if self.tp_comm_overlap is not None:
            check_overlap(self)
            y = linear_reduce_scatter(x, self.weight, self.tp_group, self.tp_comm_overlap)
            return y if self.bias is None else y + self.bias
        y = deferrable_linear(x, self.weight) if self.fp8 is None else \
            fp8_linear(x, self.weight, None, self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocab rows; rows of other ranks contribute zeros, summed.

    `num_embeddings` is the padded vocab (a multiple of tp); rows >= `vocab_size` are
    padding and start at zero. With `reduce_scatter_embeddings` (sequence parallelism) the
    output is sequence-first and reduce-scattered: [s/tp, b, h]; else [b, s, h]. With
    `keep_layout` too, dim 0 of the output is reduce-scattered as it comes (a user model's
    own layout, see parallelize.py): [s/tp, b, h] for [s, b] ids, [b/tp, s, h] for [b, s].
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group: Group = None,
                 vocab_size: Optional[int] = None, init_std: float = 0.02,
                 reduce_scatter_embeddings: bool = False, keep_layout: bool = False,
                 params_dtype: torch.dtype = torch.float32, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and tp_size(tp_group) > 1
        self.keep_layout = keep_layout
        per_partition = divide(num_embeddings, tp_size(tp_group),
                               "padded vocab size across tensor-parallel ranks")
        self.vocab_start = tp_rank(tp_group) * per_partition
        self.vocab_end = self.vocab_start + per_partition
        self.weight = _empty((per_partition, embedding_dim), params_dtype, device)
        set_parallel_attributes(self.weight, InitSpec("normal", (num_embeddings, embedding_dim),
                                                      init_std, vocab_size), partition_dim=0)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if tp_size(self.tp_group) > 1:
            outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
            local_ids = (input_ids - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(input_ids, self.weight)
        if self.reduce_scatter_embeddings:
            if not self.keep_layout:
                out = out.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_parallel_region(out, self.tp_group)
