"""A rank's model chunks and ZeRO shards as pieces of global tensors, for torch_dist.

Names are the single-device model's parameter names (`embedding.word_embeddings.weight`,
`decoder.layers.<global layer>.…`): a chunk built for a pipeline stage already names its
layers by global number. Keys of the checkpoint:

    model.<name>              the weights, in the model's dtype; persistent buffers (an MoE
                              router's expert bias) whole, written by tp and dp rank 0
    optimizer.master.<name>   fp32 master weights (bf16/fp16 models; fp32 masters equal
                              the weights and are not stored twice)
    optimizer.<state>.<name>  each per-element optimizer state (exp_avg, exp_avg_sq, ...)

Which rank writes what: every element once. ZeRO's shard of a parameter is a range of its
flattened elements (cut into boxes, torch_dist/layout.py) and is written by the rank of its
dp x cp group that owns it (ZeRO shards over dp x cp; stage 0 keeps no shards: dp x cp rank 0
writes); an expert weight's box
(experts over ep, each expert's ffn over etp) is written likewise by the owner in its
expert-data-parallel group, whatever its tp rank; a tensor replicated over tp (norms,
row-parallel biases) is written by tp rank 0; the tied output weight of a last
pipeline stage is the embedding of the first and is written by the first only. No
parameter is gathered to save it, and every rank writes about 1/world of the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AbstractSet, Any, Dict, Iterator, List, Set, Tuple

import torch

from gigatron.training.checkpoint.torch_dist.layout import (Box, DimSplit, TensorPlacement,
                                                            flat_range_boxes)
from gigatron.training.checkpoint.torch_dist.planner import ShardedValue

if TYPE_CHECKING:
    from gigatron.parallel.zero.flat_group import FlatGroup
    from gigatron.parallel.zero.optimizer import ZeroOptimizer

MODEL = "model."
MASTER = "optimizer.master."
COMMON = "common"
WORD_EMBEDDING = "embedding.word_embeddings.weight"
TIED_OUTPUT = "output_layer.weight"
SAVED_ELSEWHERE = "checkpoint_saved_elsewhere"  # a copy that another rank saves


def mark_saved_elsewhere(param: torch.Tensor) -> None:
    """Tag `param` as a copy of the parameter of the same name that another rank saves (a
    PipelineModule's tied module on its last stage): it is read at load, never written."""
    setattr(param, SAVED_ELSEWHERE, True)


def optimizer_key(state: str) -> str:
    """The checkpoint prefix of a per-element optimizer state."""
    return f"optimizer.{state}."


def rng_key(tp_rank: int, pp_rank: int) -> str:
    """RNG states are the same on every dp rank of a (tp, pp) position (Megatron's seeding)."""
    return f"rng.tp{tp_rank}.pp{pp_rank}"


def placement_of(param: torch.Tensor, tp_rank: int, tp_size: int) -> TensorPlacement:
    """Where `param` (this rank's tensor) sits in its global tensor, from the tags the
    tensor-parallel layers put on it (parallel/tensor/init.py): the full shape, the
    partition dimension and stride, the vocabulary rows that are not padding; an expert
    weight's box from its expert-parallel splits (parallel/expert/init.py)."""
    local = tuple(param.shape)
    spec = getattr(param, "init_spec", None)
    if spec is None:
        return TensorPlacement(local, local)
    full = tuple(spec.full_shape)
    global_shape = full if spec.valid_rows is None else (spec.valid_rows,) + full[1:]
    expert_splits = getattr(param, "expert_splits", None)
    if getattr(param, "expert_parallel", False) and expert_splits:
        return TensorPlacement(global_shape, local, expert_splits=tuple(
            DimSplit(dim, _blocks(full[dim], stride), rank, size)
            for dim, rank, size, stride in expert_splits))
    if getattr(param, "tensor_model_parallel", False):
        dim = getattr(param, "partition_dim")
        stride = getattr(param, "partition_stride", 1)
        return TensorPlacement(global_shape, local, dim, _blocks(full[dim], stride), tp_rank,
                               tp_size)
    if global_shape != local:  # a padded table that is not split: its padding is dropped
        return TensorPlacement(global_shape, local, 0, (local[0],))
    return TensorPlacement(global_shape, local)


def _blocks(full_size: int, stride: Any) -> Tuple[int, ...]:
    """The full sizes of the stacked blocks of a dimension (parallel/tensor/init.py's Stride:
    k equal blocks, or the sizes of unequal ones)."""
    return tuple(stride) if isinstance(stride, tuple) else (full_size // stride,) * stride


def global_names(chunks: List[torch.nn.Module]) -> Dict[int, Tuple[str, bool]]:
    """id(parameter) -> (global name, whether this copy is the one saved): the tied output
    weight of a last stage without the embedding is a copy of the embedding, and so is the
    embedding that multi-token prediction keeps there."""
    names: Dict[int, Tuple[str, bool]] = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if getattr(param, "shared_embedding_copy", False) or (
                    name == TIED_OUTPUT and getattr(param, "shared_embedding", False)):
                names[id(param)] = (WORD_EMBEDDING, False)
            elif getattr(param, SAVED_ELSEWHERE, False):
                names[id(param)] = (name, False)
            else:
                names[id(param)] = (name, True)
    return names


def persistent_buffers(chunks: List[torch.nn.Module]) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, tensor) of every buffer the chunks' state dicts hold, each name once."""
    seen: Set[str] = set()
    for chunk in chunks:
        for name, value in chunk.state_dict(keep_vars=True).items():
            if not isinstance(value, torch.nn.Parameter) and name not in seen:
                seen.add(name)
                yield name, value


def add_flat(value: ShardedValue, flat: torch.Tensor, start: int,
             placement: TensorPlacement) -> None:
    """Add the pieces of `flat`, the elements [start, start + len(flat)) of a local tensor
    placed by `placement`, to `value` (views of `flat`: a load writes through them)."""
    for position, box in flat_range_boxes(placement.local_shape, start, flat.numel()):
        block = flat[position:position + box.numel].view(box.sizes)
        for sub, offsets in placement.pieces(box):
            value.add(offsets, _narrow(block, box, sub))


def add_whole(value: ShardedValue, tensor: torch.Tensor, placement: TensorPlacement) -> None:
    """Add every globally existing part of a whole local tensor to `value` (views)."""
    whole = Box((0,) * tensor.dim(), tuple(tensor.shape))
    for sub, offsets in placement.pieces(whole):
        value.add(offsets, _narrow(tensor, whole, sub))


def _narrow(tensor: torch.Tensor, box: Box, sub: Box) -> torch.Tensor:
    for dim, (outer, inner, size) in enumerate(zip(box.offsets, sub.offsets, sub.sizes)):
        if size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, inner - outer, size)
    return tensor


@dataclass
class ShardPiece:
    """One parameter's elements in this rank's ZeRO shard of a flat group."""

    group: int  # index into zero.flat_groups
    name: str  # global name
    placement: TensorPlacement
    start: int  # first element, in the parameter's flattened local tensor
    bucket: int  # the bucket holding it
    in_bucket: int  # position within this rank's slice of the bucket
    length: int
    saved_here: bool  # this rank writes it (see the module doc)

    def position(self, g: "FlatGroup") -> int:
        """Position within the group's master shard."""
        return g.buckets[self.bucket].shard_offset + self.in_bucket


def shard_pieces(zero: "ZeroOptimizer", names: Dict[int, Tuple[str, bool]], tp_rank: int,
                 tp_size: int) -> Iterator[ShardPiece]:
    """Every piece of a parameter in this rank's ZeRO shards, in group and bucket order."""
    from gigatron.parallel.zero.layout import shard_overlaps

    for index, g in enumerate(zero.flat_groups):
        dp_owner = g.ways > 1 or g.dp_rank == 0
        for b in g.buckets:
            for idx, start, in_bucket, length in shard_overlaps(b, g.numels, g.rank_in_shard):
                param = g.params[idx]
                name, owner = names[id(param)]
                placement = placement_of(param, tp_rank, tp_size)
                yield ShardPiece(index, name, placement, start, b.index, in_bucket, length,
                                 owner and dp_owner and (tp_rank == 0 or _own_box(placement)))


def _own_box(placement: TensorPlacement) -> bool:
    """Whether the tensor is not a copy of its tp peers': split over tp, or an expert box
    (whose copies are the expert-data-parallel group's; ZeRO's expert groups shard and
    rank over it)."""
    return bool(placement.expert_splits) or \
        (placement.partition_dim is not None and placement.tp_size > 1)


def _values(values: Dict[str, ShardedValue], key: str, placement: TensorPlacement
            ) -> ShardedValue:
    if key not in values:
        values[key] = ShardedValue(placement.global_shape)
    return values[key]


def optimizer_state(zero: "ZeroOptimizer", g: "FlatGroup"
                    ) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    """A flat group's optimizer state: (per-element tensors shaped like the master shard,
    scalars such as the step count)."""
    per_element, scalars = {}, {}
    for key, value in zero.optimizer.state.get(g.master, {}).items():
        if isinstance(value, torch.Tensor) and value.shape == g.master.shape and value.dim():
            per_element[key] = value
        else:
            scalars[key] = value
    return per_element, scalars


def optimizer_common(zero: "ZeroOptimizer", scalars: Dict[str, Any]) -> Dict[str, Any]:
    """The optimizer's part of `common`: which per-element states exist, the scalar state
    (`zero_state_to_save`'s), the loss scaler and the skipped steps."""
    return {"per_element": sorted({k for g in zero.flat_groups
                                   for k in optimizer_state(zero, g)[0]}),
            "scalars": scalars, "scaler": zero.scaler.state_dict(),
            "scaler_type": type(zero.scaler).__name__, "skipped_steps": zero.skipped_steps}


def zero_state_to_save(zero: "ZeroOptimizer", chunks: List[torch.nn.Module], tp_rank: int,
                       tp_size: int, replica_rank: int, with_optimizer: bool
                       ) -> Tuple[Dict[str, ShardedValue], Dict[str, Any]]:
    """The pieces this rank writes (weights, and masters + optimizer state when asked), and
    the optimizer's scalar state (one value per key: every group steps together).
    `replica_rank`: this rank's index among the model's copies (its dp x cp group)."""
    names = global_names(chunks)
    values: Dict[str, ShardedValue] = {}
    masters = zero.param_dtype != torch.float32
    per_group = [optimizer_state(zero, g) for g in zero.flat_groups]
    for piece in shard_pieces(zero, names, tp_rank, tp_size):
        if not piece.saved_here:
            continue
        g = zero.flat_groups[piece.group]
        at = piece.position(g)
        weights = g.param_shard_piece(g.buckets[piece.bucket])
        add_flat(_values(values, MODEL + piece.name, piece.placement),
                 weights[piece.in_bucket:piece.in_bucket + piece.length], piece.start,
                 piece.placement)
        if not with_optimizer:
            continue
        sources = dict(per_group[piece.group][0])
        if masters:
            sources["master"] = g.master
        for key, tensor in sources.items():
            prefix = MASTER if key == "master" else optimizer_key(key)
            add_flat(_values(values, prefix + piece.name, piece.placement),
                     tensor[at:at + piece.length], piece.start, piece.placement)
    _add_unmanaged_weights(values, zero, chunks, names, tp_rank, tp_size, replica_rank)
    return values, _common_scalars(per_group)


def _add_unmanaged_weights(values: Dict[str, ShardedValue], zero: "ZeroOptimizer",
                           chunks: List[torch.nn.Module], names: Dict[int, Tuple[str, bool]],
                           tp_rank: int, tp_size: int, replica_rank: int) -> None:
    """Parameters ZeRO does not train (frozen) are saved whole by the first copy of the
    model (dp x cp rank 0; an expert box by expert-data-parallel rank 0)."""
    from gigatron.parallel import comm

    managed = {id(p) for g in zero.flat_groups for p in g.params}
    edp = zero.process_groups.expert_dp
    edp_rank = replica_rank if edp is None else comm.group_rank(edp)
    for chunk in chunks:
        for param in chunk.parameters():
            name, owner = names[id(param)]
            placement = placement_of(param, tp_rank, tp_size)
            first = edp_rank if placement.expert_splits else replica_rank
            if id(param) in managed or not owner or first or \
                    (tp_rank and not _own_box(placement)):
                continue
            add_whole(_values(values, MODEL + name, placement), param.detach(), placement)


def _common_scalars(per_group: List[Tuple[Dict[str, torch.Tensor], Dict[str, Any]]]
                    ) -> Dict[str, Any]:
    scalars: Dict[str, Any] = {}
    for _, group_scalars in per_group:
        for key, value in group_scalars.items():
            if key in scalars and _number(scalars[key]) != _number(value):
                raise ValueError(f"optimizer state {key!r} differs between parameter groups "
                                 f"({_number(scalars[key])} and {_number(value)}): the "
                                 f"torch_dist format stores one value for all")
            scalars[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
    return scalars


def _number(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def model_weights_to_load(chunks: List[torch.nn.Module], tp_rank: int, tp_size: int
                          ) -> Dict[str, ShardedValue]:
    """Views of every chunk parameter and persistent buffer (an MoE router's expert bias),
    keyed by checkpoint name (the tied output weight of a last stage reads the embedding)."""
    names = global_names(chunks)
    values: Dict[str, ShardedValue] = {}
    for chunk in chunks:
        for param in chunk.parameters():
            name, _ = names[id(param)]
            placement = placement_of(param, tp_rank, tp_size)
            key = MODEL + name
            if key in values:  # the same global tensor twice on one rank: one read is enough
                continue
            add_whole(_values(values, key, placement), param.data, placement)
    for name, tensor in persistent_buffers(chunks):
        placement = placement_of(tensor, 0, 1)
        add_whole(_values(values, MODEL + name, placement), tensor.data, placement)
    return values


@dataclass
class ResumedZero:
    """Tensors a load fills, laid out like this rank's ZeRO shards: the live master shards
    and optimizer states themselves (a state the optimizer does not hold yet is made here,
    once, where it will stay)."""

    masters: List[torch.Tensor]
    per_element: List[Dict[str, torch.Tensor]]


def zero_state_to_load(zero: "ZeroOptimizer", chunks: List[torch.nn.Module], tp_rank: int,
                       tp_size: int, state_keys: List[str], master_prefix: str
                       ) -> Tuple[Dict[str, ShardedValue], ResumedZero]:
    """This rank's master shards (read from `master_prefix`, the masters or the fp32
    weights) and per-element states, and the pieces a load writes into them. The load
    writes into the live tensors, not into copies: an offloaded optimizer's host holds
    12 B/param and no second set (a failed read leaves them half written; every rank then
    stops, see orchestrator.py)."""
    names = global_names(chunks)
    # an optimizer with several rules (Muon: momentum or Adam's moments) says which
    # states each of its tensors keeps; the others keep every saved one
    keeps = getattr(zero.optimizer, "state_keys", lambda p: state_keys)
    resumed = ResumedZero([g.master for g in zero.flat_groups],
                          [{k: _live_state(zero, g, k) for k in state_keys
                            if k in keeps(g.master)} for g in zero.flat_groups])
    values: Dict[str, ShardedValue] = {}
    for piece in shard_pieces(zero, names, tp_rank, tp_size):
        g = zero.flat_groups[piece.group]
        at = piece.position(g)
        targets = {master_prefix: resumed.masters[piece.group]}
        targets.update({optimizer_key(k): t for k, t in
                        resumed.per_element[piece.group].items()})
        for prefix, tensor in targets.items():
            add_flat(_values(values, prefix + piece.name, piece.placement),
                     tensor[at:at + piece.length], piece.start, piece.placement)
    return values, resumed


def _live_state(zero: "ZeroOptimizer", g: "FlatGroup", key: str) -> torch.Tensor:
    """The optimizer's per-element state `key` of `g`'s master shard, made if missing."""
    value = zero.optimizer.state.get(g.master, {}).get(key)
    if isinstance(value, torch.Tensor) and value.shape == g.master.shape and \
            value.dtype == g.master.dtype:
        return value.detach()
    return torch.zeros_like(g.master)


def host_optimizer_storages(zero: "ZeroOptimizer") -> Set[int]:
    """The storages (data pointers) of the master shards and per-element optimizer states
    that live on the host: an offloaded run's, which only the optimizer step writes."""
    tensors = [g.master for g in zero.flat_groups]
    tensors += [t for g in zero.flat_groups for t in optimizer_state(zero, g)[0].values()]
    return {t.untyped_storage().data_ptr() for t in tensors if t.device.type == "cpu"}


def staged(values: Dict[str, Any], live: AbstractSet[int] = frozenset()) -> Dict[str, Any]:
    """A copy of the state in CPU memory (for a save that runs while training goes on),
    except the pieces of the host storages in `live`, which the caller keeps unchanged
    until the save is written (an offloaded run's masters and optimizer state: their copy
    would be 12 B/param more on the host; the next optimizer step waits instead)."""
    def copy(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() in live:
            return t.detach()
        return t.detach().to("cpu", copy=True)

    out: Dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, ShardedValue):
            out[key] = ShardedValue(value.global_shape, [(o, copy(t)) for o, t in value.pieces])
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu", copy=True)
        else:
            out[key] = value
    return out


def nbytes(values: Dict[str, Any]) -> int:
    """Bytes of the tensors this rank writes (the size estimate of a full-disk message)."""
    total = 0
    for value in values.values():
        tensors = [t for _, t in value.pieces] if isinstance(value, ShardedValue) else \
            [value] if isinstance(value, torch.Tensor) else []
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
