"""Which parameters each (pipeline rank, virtual chunk) holds, read from the model itself.

The planner needs every tensor-parallel rank's parameters in the order GPTModel registers
them, with the two tags ZeRO groups by (ndim >= 2 decays; kind = shared embedding /
sequence-parallel / default), because flat buffers are padded per group and per bucket:
exact bytes need exact shapes. They are read from GPTModel built on the meta device over a
`ShapeOnlyGroup` of the layout's tensor-parallel size, so the model is the one description.
Every decoder layer has the same parameters: one model per (config, tp, pre_process,
post_process), with a single layer, is built and cached, and a chunk repeats that layer's
parameters for each of its layers, so a search over many layouts stays fast.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel.comm import ShapeOnlyGroup
from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.parallel.zero.param_groups import param_kind

LAYER_PREFIX = "decoder.layers."  # TransformerBlock's layers, by global layer number


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


@lru_cache(maxsize=256)
def _pieces(config: _ByValue, tp: int, pre: bool, post: bool, has_layers: bool) -> _Pieces:
    """Build the chunk on meta with layer 0 only (if it has layers) and split its list."""
    model = GPTModel(config.config, tp_group=ShapeOnlyGroup(tp), pre_process=pre,
                     post_process=post, layer_range=[0] if has_layers else [],
                     device=torch.device("meta"))
    specs = [ParamSpec(name, tuple(p.shape), param_kind(p))
             for name, p in model.named_parameters()]
    layer = [n for n, s in enumerate(specs) if s.name.startswith(f"{LAYER_PREFIX}0.")]
    if not layer:
        return _Pieces(tuple(specs), (), ())
    start, stop = layer[0], layer[-1] + 1
    assert layer == list(range(start, stop)), "a layer's parameters are registered together"
    cut = len(f"{LAYER_PREFIX}0.")
    relative = tuple(ParamSpec(s.name[cut:], s.shape, s.kind) for s in specs[start:stop])
    return _Pieces(tuple(specs[:start]), relative, tuple(specs[stop:]))


def chunk_parameters(c: TransformerConfig, tp: int, partition: PipelinePartition,
                     pp_rank: int, chunk: int) -> List[ParamSpec]:
    """The parameters of GPTModel chunk `chunk` of pipeline rank `pp_rank` on one tp rank."""
    layers = partition.layer_range(pp_rank, chunk)
    pieces = _pieces(_ByValue(c), tp, partition.pre_process(pp_rank, chunk),
                     partition.post_process(pp_rank, chunk), len(layers) > 0)
    specs = list(pieces.before)
    for index in layers:
        specs += [ParamSpec(f"{LAYER_PREFIX}{index}.{s.name}", s.shape, s.kind)
                  for s in pieces.layer]
    return specs + list(pieces.after)


def stage_parameters(c: TransformerConfig, tp: int, partition: PipelinePartition,
                     pp_rank: int) -> List[List[ParamSpec]]:
    """Every chunk's parameters on pipeline rank `pp_rank` (one tp rank's slice)."""
    return [chunk_parameters(c, tp, partition, pp_rank, chunk)
            for chunk in range(partition.virtual_chunks)]
