"""Which parameters each (pipeline rank, virtual chunk) holds, read from the model itself.

The planner needs every tensor-parallel rank's parameters in the order GPTModel registers
them, with the two tags ZeRO groups by (ndim >= 2 decays; kind = shared embedding /
sequence-parallel / default), because flat buffers are padded per group and per bucket:
exact bytes need exact shapes. They are read from GPTModel built on the meta device over a
`ShapeOnlyGroup` of the layout's tensor-parallel size, so the model is the one description.
Decoder layers of one kind (dense, or MoE where moe_layer_freq puts one) have the same
parameters: one model per (config, tp, pre_process, post_process, kind), with a single layer,
is built and cached, and a chunk repeats that layer's parameters for each of its layers, so a
search over many layouts stays fast. Weights of tensor-parallel linears (the output layer's
too) are tagged `deferrable`: a split backward keeps their inputs and output gradients for W.

Expert parallelism: the meta model is built as training/run/builders.py builds it, with the
MoE layers' dispatcher over `ShapeOnlyGroup`s of the expert sizes (ep, etp), so its expert
weights are one rank's box [E/ep, h, (2)f/etp] / [E/ep, f/etp, h], tagged for ZeRO's
expert-data-parallel group; at ep 1 with etp = tp every expert stays on every rank, as the
trainer keeps it (`is_expert_parallel`).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.parallel.comm import ShapeOnlyGroup
from gigatron.parallel.expert.dispatchers import expert_dispatcher_factory
from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from gigatron.parallel.zero.param_groups import param_kind

LAYER_PREFIX = "decoder.layers."  # TransformerBlock's layers, by global layer number
EXPERT_MARK = "mlp.experts."  # a routed expert's stacked weights (not the shared experts')


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of one tensor-parallel rank: name, shape and ZeRO's grouping tags."""

    name: str
    shape: Tuple[int, ...]
    kind: str = "default"  # 'default' | 'sequence_parallel' | 'shared_embedding'
    # the weight of a tensor-parallel linear (the output layer's too), whose gradient a split
    # backward defers to W (parallel/tensor/wgrad.py)
    deferrable: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def is_expert(self) -> bool:
        """A routed expert's weights (ZeRO shards them over edp when kind is 'expert')."""
        return EXPERT_MARK in self.name


class _ByValue:
    """A TransformerConfig hashed by its fields' values (it is mutable, so unhashable)."""

    def __init__(self, config: TransformerConfig) -> None:
        self.config, self.key = config, repr(config)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _ByValue) and self.key == other.key


@dataclass(frozen=True)
class _Pieces:
    """A chunk's parameters around its layers, and one layer's (names after its number)."""

    before: Tuple[ParamSpec, ...]
    layer: Tuple[ParamSpec, ...]
    after: Tuple[ParamSpec, ...]


def is_expert_parallel(tp: int, ep: int, etp: int) -> bool:
    """Whether the trainer gives the MoE layers an expert-parallel dispatcher (each rank its
    box of the experts, its own tokens routed): training/run/builders.py's rule."""
    return not (ep == 1 and etp == tp)


@lru_cache(maxsize=256)
def _pieces(config: _ByValue, tp: int, pre: bool, post: bool, layer: Optional[int],
            ep: int = 1, etp: Optional[int] = None) -> _Pieces:
    """Build the chunk on meta with global layer `layer` only (None: no layer) and split its
    list (ep, etp: the expert layers' sizes, rank 0's box)."""
    c, etp = config.config, tp if etp is None else etp
    factory = None
    if c.num_moe_experts is not None and is_expert_parallel(tp, ep, etp):
        factory = expert_dispatcher_factory(c.moe_token_dispatcher_type, ShapeOnlyGroup(ep),
                                            ShapeOnlyGroup(etp))
    model = GPTModel(c, tp_group=ShapeOnlyGroup(tp), pre_process=pre, post_process=post,
                     layer_range=[] if layer is None else [layer],
                     device=torch.device("meta"), dispatcher_factory=factory)
    linears = {id(m.weight) for m in model.modules()
               if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
               and m.weight is not None}
    if post:  # the output layer's weight, the word embeddings' when tied on one stage
        linears.add(id(model.output_weight()))
    specs = [ParamSpec(name, tuple(p.shape), param_kind(p), id(p) in linears)
             for name, p in model.named_parameters()]
    prefix = f"{LAYER_PREFIX}{layer}."
    members = [n for n, s in enumerate(specs) if s.name.startswith(prefix)]
    if not members:
        return _Pieces(tuple(specs), (), ())
    start, stop = members[0], members[-1] + 1
    assert members == list(range(start, stop)), "a layer's parameters are registered together"
    relative = tuple(ParamSpec(s.name[len(prefix):], s.shape, s.kind, s.deferrable)
                     for s in specs[start:stop])
    return _Pieces(tuple(specs[:start]), relative, tuple(specs[stop:]))


def chunk_parameters(c: TransformerConfig, tp: int, partition: PipelinePartition,
                     pp_rank: int, chunk: int, ep: int = 1,
                     etp: Optional[int] = None) -> List[ParamSpec]:
    """The parameters of GPTModel chunk `chunk` of pipeline rank `pp_rank` on one tp rank
    (expert weights: one rank's box at expert sizes ep x etp; etp None: tp, Megatron's)."""
    layers = partition.layer_range(pp_rank, chunk)
    pattern = moe_layer_pattern(c)
    key, pre, post = _ByValue(c), partition.pre_process(pp_rank, chunk), \
        partition.post_process(pp_rank, chunk)
    # a representative global layer of each kind in the chunk (dense models: layer 0)
    pieces = {kind: _pieces(key, tp, pre, post, pattern.index(kind), ep, etp)
              for kind in dict.fromkeys(pattern[i] for i in layers)}
    ends = next(iter(pieces.values())) if pieces else _pieces(key, tp, pre, post, None)
    specs = list(ends.before)
    for index in layers:
        specs += [ParamSpec(f"{LAYER_PREFIX}{index}.{s.name}", s.shape, s.kind, s.deferrable)
                  for s in pieces[pattern[index]].layer]
    return specs + list(ends.after)


def stage_parameters(c: TransformerConfig, tp: int, partition: PipelinePartition,
                     pp_rank: int, ep: int = 1,
                     etp: Optional[int] = None) -> List[List[ParamSpec]]:
    """Every chunk's parameters on pipeline rank `pp_rank` (one tp rank's slice)."""
    return [chunk_parameters(c, tp, partition, pp_rank, chunk, ep, etp)
            for chunk in range(partition.virtual_chunks)]
