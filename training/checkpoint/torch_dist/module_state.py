"""The torch_dist checkpoint of any nn.Module trained by ZeRO (the engine's), beyond ZeRO's
shards (training/checkpoint/torch_dist/state.py):

    model.<buffer name>     each persistent buffer (batch-norm statistics, ...), whole,
                            written by dp rank 0 (and tp rank 0) of the rank's copy

Names are the module's own (`module.state_dict()`'s), so any layout that names its
parameters alike loads the checkpoint: a plain module on any number of ranks, or a
PipelineModule at any number of stages (it names layers by their global index). The tied
module of a PipelineModule's last stage is a copy (`state.mark_saved_elsewhere`): read at
load, never written; its buffers, if any, are the same box the first stage writes, and DCP
keeps one of the two (its planner drops duplicate boxes).

A weights-only load (DeepSpeed's load_optimizer_states=False, load_module_only=True) reads
the weights straight into ZeRO's parameter shards and refreshes the fp32 masters from them,
as DeepSpeed does; nothing is gathered, at any ZeRO stage.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Set

import torch

from gigatron.training.checkpoint.torch_dist.planner import ShardedValue
from gigatron.training.checkpoint.torch_dist.state import (MODEL, add_flat, add_whole,
                                                           global_names, persistent_buffers,
                                                           placement_of, shard_pieces)

if TYPE_CHECKING:
    from gigatron.parallel.zero.optimizer import ZeroOptimizer


def checkpoint_names(chunks: List[torch.nn.Module]) -> Set[str]:
    """Every key of the checkpoint this rank reads its module from (parameters, buffers)."""
    names = {MODEL + name for name, _ in global_names(chunks).values()}
    return names | {MODEL + name for name, _ in persistent_buffers(chunks)}


def buffers_to_save(chunks: List[torch.nn.Module], writer: bool) -> Dict[str, ShardedValue]:
    """The chunks' persistent buffers, whole, when this rank is its copy's `writer`."""
    values: Dict[str, ShardedValue] = {}
    if writer:
        for name, tensor in persistent_buffers(chunks):
            values[MODEL + name] = ShardedValue(tuple(tensor.shape))
            add_whole(values[MODEL + name], tensor.detach(), placement_of(tensor, 0, 1))
    return values


def module_tensors_to_load(zero: "ZeroOptimizer", chunks: List[torch.nn.Module],
                           tp_rank: int, tp_size: int) -> Dict[str, ShardedValue]:
    """Views of what a load reads straight into the module: its persistent buffers and the
    parameters ZeRO does not train (frozen ones), whole (ZeRO never partitions them)."""
    managed = {id(p) for g in zero.flat_groups for p in g.params}
    names = global_names(chunks)
    values: Dict[str, ShardedValue] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            key = MODEL + names[id(param)][0]
            if id(param) in managed or key in values:
                continue
            placement = placement_of(param, tp_rank, tp_size)
            values[key] = ShardedValue(placement.global_shape)
            add_whole(values[key], param.data, placement)
    for name, tensor in persistent_buffers(chunks):
        values[MODEL + name] = ShardedValue(tuple(tensor.shape))
        add_whole(values[MODEL + name], tensor.data, placement_of(tensor, 0, 1))
    return values


def zero_weights_to_load(zero: "ZeroOptimizer", chunks: List[torch.nn.Module], tp_rank: int,
                         tp_size: int) -> Dict[str, ShardedValue]:
    """Views of this rank's slices of ZeRO's parameter buffers (in the model's dtype),
    keyed by checkpoint name: a weights-only load reads into them, then `publish_weights`."""
    names = global_names(chunks)
    values: Dict[str, ShardedValue] = {}
    for piece in shard_pieces(zero, names, tp_rank, tp_size):
        g = zero.flat_groups[piece.group]
        weights = g.param_shard_piece(g.buckets[piece.bucket])
        key = MODEL + piece.name
        if key not in values:
            values[key] = ShardedValue(piece.placement.global_shape)
        add_flat(values[key], weights[piece.in_bucket:piece.in_bucket + piece.length],
                 piece.start, piece.placement)
    return values


def publish_weights(zero: "ZeroOptimizer") -> None:
    """Collective over dp, after `zero_weights_to_load`'s views were filled: the fp32
    masters from the weights, then every rank's full parameters (stages 1-2 gather them)."""
    for g in zero.flat_groups:
        g.refresh_master()
    handles = [h for g in zero.flat_groups for h in g.write_back()]
    for h in handles:
        h.wait()
