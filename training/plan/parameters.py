"""Which parameters each (pipeline rank, virtual chunk) holds, without building the model.

The planner needs every tensor-parallel rank's parameters in the order GPTModel registers
them, with the two tags ZeRO groups by (ndim >= 2 decays; kind = shared embedding /
sequence-parallel / default), because flat buffers are padded per group and per bucket:
exact bytes need exact shapes. `stage_parameters` lists them for any size of model in
microseconds; tests/test_plan_memory.py holds it equal to the built model's
`named_parameters()` on every layout it tries.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

from gigatron.models.config import TransformerConfig
from gigatron.parallel.pipeline.partition import PipelinePartition


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of one tensor-parallel rank: name, shape and ZeRO's grouping tags."""

    name: str
    shape: Tuple[int, ...]
    kind: str = "default"  # 'default' | 'sequence_parallel' | 'shared_embedding'

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _norm(prefix: str, c: TransformerConfig, sp: bool) -> List[ParamSpec]:
    kind = "sequence_parallel" if sp else "default"
    h = c.hidden_size
    out = [ParamSpec(f"{prefix}.weight", (h,), kind)]
    if c.normalization != "RMSNorm":
        out.append(ParamSpec(f"{prefix}.bias", (h,), kind))
    return out


def _linear(prefix: str, out_features: int, in_features: int, bias: bool,
            bias_kind: str = "default") -> List[ParamSpec]:
    specs = [ParamSpec(f"{prefix}.weight", (out_features, in_features))]
    return specs + ([ParamSpec(f"{prefix}.bias", (out_features,), bias_kind)] if bias else [])


def layer_parameters(c: TransformerConfig, tp: int, index: int) -> List[ParamSpec]:
    """One TransformerLayer's parameters on one tp rank, in registration order."""
    sp = c.sequence_parallel and tp > 1
    h, d, bias = c.hidden_size, c.head_dim, c.add_bias_linear
    qkv = c.num_query_groups * (c.num_attention_heads // c.num_query_groups + 2) * d
    fc1 = 2 * c.ffn_hidden_size if c.activation == "swiglu" else c.ffn_hidden_size
    row_bias = "sequence_parallel" if sp else "default"
    p = f"decoder.layers.{index}"
    return (_norm(f"{p}.input_layernorm", c, sp)
            + _linear(f"{p}.self_attention.linear_qkv", qkv // tp, h, bias)
            + _linear(f"{p}.self_attention.linear_proj", h, c.num_attention_heads * d // tp,
                      bias, row_bias)
            + _norm(f"{p}.pre_mlp_layernorm", c, sp)
            + _linear(f"{p}.mlp.linear_fc1", fc1 // tp, h, bias)
            + _linear(f"{p}.mlp.linear_fc2", h, c.ffn_hidden_size // tp, bias, row_bias))


def chunk_parameters(c: TransformerConfig, tp: int, partition: PipelinePartition,
                     pp_rank: int, chunk: int) -> List[ParamSpec]:
    """The parameters of GPTModel chunk `chunk` of pipeline rank `pp_rank` on one tp rank."""
    pre, post = partition.pre_process(pp_rank, chunk), partition.post_process(pp_rank, chunk)
    sp = c.sequence_parallel and tp > 1
    tied = not c.untie_embeddings_and_output_weights
    shared = "shared_embedding" if tied and not (pre and post) else "default"
    vocab = c.padded_vocab_size(tp) // tp
    specs: List[ParamSpec] = []
    if pre:
        specs.append(ParamSpec("embedding.word_embeddings.weight", (vocab, c.hidden_size),
                               shared))
        if c.position_embedding_type == "learned_absolute":
            specs.append(ParamSpec("embedding.position_embeddings.weight",
                                   (c.max_position_embeddings, c.hidden_size),
                                   "sequence_parallel" if sp else "default"))
    for index in partition.layer_range(pp_rank, chunk):
        specs += layer_parameters(c, tp, index)
    if post:
        specs += _norm("decoder.final_layernorm", c, sp)
        if not (pre and tied):
            specs.append(ParamSpec("output_layer.weight", (vocab, c.hidden_size), shared))
    return specs


def stage_parameters(c: TransformerConfig, tp: int, partition: PipelinePartition,
                     pp_rank: int) -> List[List[ParamSpec]]:
    """Every chunk's parameters on pipeline rank `pp_rank` (one tp rank's slice)."""
    return [chunk_parameters(c, tp, partition, pp_rank, chunk)
            for chunk in range(partition.virtual_chunks)]
