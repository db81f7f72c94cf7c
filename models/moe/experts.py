"""The routed experts of a mixture-of-experts layer, on one device.

Tokens are permuted so that each expert's rows are contiguous (Megatron-Core's permute:
gather rows by the routing map, expert-major), every expert MLP runs on its rows, and the
outputs, weighted by the router probability, are scatter-added back to their tokens
(unpermute). Expert weights are stacked per kind, `weight1` [E, h, 2f or f] and `weight2`
[E, f, h] as in Megatron-Core's GroupedMLP, so expert parallelism can later shard dim 0.
With biases (Megatron's default --add-bias-linear, as Megatron-Core's TEGroupedMLP and
SequentialMLP build them) each expert also has `bias1` [E, 2f or f], added before the
activation, and `bias2` [E, h], added to its output before the router probability weights it
(Megatron-Core: output + bias x prob); both start at zero.
The expert matmuls run as a loop over experts or as one grouped matmul (`torch._grouped_mm`,
Megatron's --moe-grouped-gemm), with the same numerics; the grouped path falls back to the
loop where the running torch cannot serve it (see `grouped_mm_supported`).
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F

from gigatron.models.attention_kinds import GATED
from gigatron.models.transformer import ACTIVATIONS, mlp_activation
from gigatron.parallel.expert.dispatch import LocalDispatcher

# dtypes torch._grouped_mm accepts, by device type; CUDA's kernel is bf16-only on the
# versions we know, so other dtypes take the loop there rather than fail at run time
_GROUPED_MM_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}
# torch._grouped_mm needs every row stride to be a multiple of 16 bytes
_GROUPED_MM_ALIGNMENT_BYTES = 16


@functools.lru_cache(maxsize=None)
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """One tiny call, once per (device type, dtype): torch versions differ in which devices
    and dtypes `torch._grouped_mm` has kernels for (2.13 serves the CPU; older ones may not)."""
    try:
        rows = torch.zeros(2, 16, dtype=dtype, device=device_type)
        weight = torch.zeros(2, 16, 16, dtype=dtype, device=device_type)
        torch._grouped_mm(rows, weight, offs=torch.tensor([1, 2], dtype=torch.int32,
                                                           device=device_type))
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


def grouped_mm_supported(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch._grouped_mm can multiply these rows by these stacked weights here."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if rows.dtype not in _GROUPED_MM_DTYPES.get(rows.device.type, ()) or weight.dtype != rows.dtype:
        return False
    if not (rows.is_contiguous() and weight.is_contiguous()):
        return False
    element = rows.element_size()
    # the row strides of the input, the weights and (for the backward) the output
    return all(size * element % _GROUPED_MM_ALIGNMENT_BYTES == 0
               for size in (rows.shape[-1], weight.shape[-1])) and \
        _grouped_mm_runs(rows.device.type, rows.dtype)


def expert_matmul(rows: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                  grouped: bool) -> torch.Tensor:
    """rows of expert e (expert-major) @ weight[e], grouped in one call or looped per expert."""
    if grouped and grouped_mm_supported(rows, weight):
        offsets = torch.cumsum(tokens_per_expert, dim=0).to(torch.int32)
        return torch._grouped_mm(rows, weight, offs=offsets)
    # the loop needs the counts on the host: one device-to-host copy per call
    chunks = torch.split(rows, tokens_per_expert.tolist())
    return torch.cat([chunk @ weight[expert] for expert, chunk in enumerate(chunks)])


class RoutedExperts(nn.Module):
    """E expert MLPs (SwiGLU or a plain activation) applied to the tokens the router sent them."""

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int,
                 activation: str = "swiglu", grouped_gemm: bool = False,
                 init_method_std: float = 0.02, output_init_std: Optional[float] = None,
                 params_dtype: torch.dtype = torch.float32,
                 device: Optional[torch.device] = None, add_bias: bool = False,
                 output_bias_slice: Tuple[int, int] = (0, 1)) -> None:
        """`output_bias_slice` (rank, size): under expert tensor parallelism each etp rank
        holds this slice of bias2's hidden columns and adds it to its partial outputs, which
        the dispatcher sums over etp, so the full bias is added once."""
        super().__init__()
        if activation not in GATED and activation not in ACTIVATIONS:
            known = ", ".join([*GATED, *ACTIVATIONS])
            raise ValueError(f"RoutedExperts activation={activation!r}: use one of {known}")
        if num_experts < 1:
            raise ValueError(f"RoutedExperts num_experts={num_experts}: needs at least 1 expert")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.swiglu = activation in GATED  # a gated unit: fc1 holds [gate, linear]
        self.activation = mlp_activation(activation)
        self.grouped_gemm = grouped_gemm
        fc1_size = 2 * ffn_hidden_size if self.swiglu else ffn_hidden_size
        # SwiGLU's fc1 output is [gate, up] along the last dim, as Megatron's gated silu
        self.weight1 = nn.Parameter(torch.empty(num_experts, hidden_size, fc1_size,
                                                dtype=params_dtype, device=device))
        self.weight2 = nn.Parameter(torch.empty(num_experts, ffn_hidden_size, hidden_size,
                                                dtype=params_dtype, device=device))
        nn.init.normal_(self.weight1, std=init_method_std)
        nn.init.normal_(self.weight2, std=init_method_std if output_init_std is None else output_init_std)
        self.output_bias_slice = output_bias_slice
        self.bias1: Optional[nn.Parameter] = None
        self.bias2: Optional[nn.Parameter] = None
        if add_bias:
            rank, size = output_bias_slice
            if hidden_size % size:
                raise ValueError(f"RoutedExperts: hidden size {hidden_size} is not divisible by "
                                 f"the expert-tensor-parallel size {size} (each etp rank holds "
                                 f"an equal slice of the experts' output biases)")
            self.bias1 = nn.Parameter(torch.zeros(num_experts, fc1_size, dtype=params_dtype,
                                                  device=device))
            self.bias2 = nn.Parameter(torch.zeros(num_experts, hidden_size // size,
                                                  dtype=params_dtype, device=device))

    def uses_grouped_mm(self, hidden: torch.Tensor) -> bool:
        """Whether forward on hidden like this one runs torch._grouped_mm (else the loop)."""
        fc1_rows = hidden.new_empty(0, self.hidden_size)
        fc2_rows = hidden.new_empty(0, self.weight2.shape[1])
        return (self.grouped_gemm and grouped_mm_supported(fc1_rows, self.weight1)
                and grouped_mm_supported(fc2_rows, self.weight2))

    def forward(self, hidden: torch.Tensor, probs: torch.Tensor,
                routing_map: torch.Tensor) -> torch.Tensor:
        """hidden [tokens, h], probs and bool routing_map [tokens, E] -> weighted sum [tokens, h]
        (every expert on this rank; an expert-parallel layer dispatches, then `forward_rows`)."""
        self._check_inputs(hidden, probs, routing_map)
        dispatcher = LocalDispatcher(self.num_experts)
        dispatched = dispatcher.dispatch(hidden, probs, routing_map)
        out = self.forward_rows(dispatched.rows, dispatched.tokens_per_expert)
        return dispatcher.combine(out, dispatched)

    def forward_rows(self, rows: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """The expert MLPs on expert-major rows [R, h] (`tokens_per_expert` rows each, in the
        order of this module's experts) -> [R, h], unweighted."""
        h = expert_matmul(rows, self.weight1, tokens_per_expert, self.grouped_gemm)
        if self.bias1 is None or self.bias2 is None:
            return expert_matmul(self.activation(h), self.weight2, tokens_per_expert,
                                 self.grouped_gemm)
        # each row's expert, from the device counts (output_size: no host read)
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.num_experts, device=rows.device), tokens_per_expert,
            output_size=rows.shape[0])
        h = self.activation(h + self.bias1[expert_of_row])
        out = expert_matmul(h, self.weight2, tokens_per_expert, self.grouped_gemm)
        rank, size = self.output_bias_slice
        width = self.bias2.shape[1]
        bias2 = F.pad(self.bias2, (rank * width, (size - rank - 1) * width))
        return out + bias2[expert_of_row]

    def _check_inputs(self, hidden: torch.Tensor, probs: torch.Tensor,
                      routing_map: torch.Tensor) -> None:
        """One clear line for inputs of the wrong shape or type."""
        if hidden.dim() != 2 or hidden.shape[1] != self.hidden_size:
            raise ValueError(f"RoutedExperts hidden has shape {tuple(hidden.shape)}: "
                             f"expected [tokens, {self.hidden_size}]; flatten [s, b, h] first")
        expected = (hidden.shape[0], self.num_experts)
        for name, tensor in (("probs", probs), ("routing_map", routing_map)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"RoutedExperts {name} has shape {tuple(tensor.shape)}: "
                                 f"expected [tokens, experts] = {list(expected)}")
        if routing_map.dtype != torch.bool:
            raise ValueError(f"RoutedExperts routing_map has dtype {routing_map.dtype}: "
                             "expected torch.bool (True where a token goes to an expert)")
