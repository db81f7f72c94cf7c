"""torch.distributed.checkpoint planners for tensors held as boxes of a global tensor.

`ShardedValue` is what a state dict given to these planners holds for a global tensor: the
global shape and this rank's pieces, each (offsets in the global tensor, a local tensor of
the piece's size). A rank may hold any number of pieces, including none, anywhere in the
global tensor: a tensor-parallel slice of stacked blocks is several boxes, a ZeRO shard's
range of flattened elements is a few more (training/checkpoint/torch_dist/layout.py).

The planners extend DCP's documented planner interface (SavePlanner.create_local_plan /
resolve_data, LoadPlanner.create_local_plan / resolve_tensor, through the default planners'
lookup hooks): each piece is one SHARD write item, and a load reads, for each piece, the
overlapping parts of whatever boxes the checkpoint was saved in (DCP's resharding,
`create_read_items_for_chunk_list`). Plain tensors and other objects keep DCP's default
handling (objects are pickled).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import (create_default_local_load_plan,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadPlan, SavePlan, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

Offsets = Tuple[int, ...]


@dataclass
class ShardedValue:
    """This rank's pieces of one global tensor: (offsets in the global tensor, tensor)."""

    global_shape: Tuple[int, ...]
    pieces: List[Tuple[Offsets, torch.Tensor]] = field(default_factory=list)

    def add(self, offsets: Sequence[int], tensor: torch.Tensor) -> None:
        if tensor.numel():
            self.pieces.append((tuple(int(o) for o in offsets), tensor))

    def chunks(self) -> List[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=t.size())
                for o, t in self.pieces]


class ShardedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one SHARD write item per piece of a ShardedValue.
    The state dict is flat: a dict value is one pickled object, not a nested state."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, ShardedValue)}
        items = list(create_default_local_save_plan(plain, self.is_coordinator).items)
        for fqn, value in self.state_dict.items():
            if isinstance(value, ShardedValue):
                items += [_write_item(fqn, value.global_shape, o, t) for o, t in value.pieces]
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardedValue):
            wanted = tuple(index.offset or ())
            for offsets, tensor in value.pieces:
                if offsets == wanted:
                    return tensor
            raise ValueError(f"{index.fqn}: this rank holds no piece at {wanted}")
        return super().lookup_object(index)

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        return _own_storage(data) if isinstance(data, torch.Tensor) else data


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A host piece aliased by a tensor whose storage is exactly its bytes. DCP clones a
    view of a larger storage before writing it and keeps every tensor of a file until the
    file is closed: one rank's whole file (an offloaded ZeRO shard's masters and optimizer
    state, 12 B/param) would sit on the host twice."""
    if tensor.device.type != "cpu" or tensor.dim() == 0 or not tensor.is_contiguous() or \
            tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    raw = torch.from_numpy(tensor.detach().view(torch.uint8).numpy())
    return raw.view(tensor.dtype).view(tensor.shape)


def _write_item(fqn: str, global_shape: Tuple[int, ...], offsets: Offsets,
                tensor: torch.Tensor) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
    return WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                     tensor_data=TensorWriteData(
                         chunk=chunk, properties=TensorProperties.create_from_tensor(tensor),
                         size=torch.Size(global_shape)))


class ShardedLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus reads into every piece of a ShardedValue from the
    saved boxes that overlap it (any layout saved, any layout loading)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: Dict[str, Any], metadata: Optional[Metadata] = None,
                       is_coordinator: bool = False) -> None:
        # The default set-up also materialises meta tensors and, in doing so, replaces
        # values it does not know (a ShardedValue) by None: every tensor here is real.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set_up_planner received it
        saved = self.metadata.state_dict_metadata
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, ShardedValue)}
        items = list(create_default_local_load_plan(plain, self.metadata, True).items)
        for fqn, value in self.state_dict.items():
            if not isinstance(value, ShardedValue):
                continue
            md = saved.get(fqn)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{fqn} is not a tensor of this checkpoint")
            if tuple(md.size) != tuple(value.global_shape):
                raise ValueError(f"{fqn} has shape {tuple(md.size)} in the checkpoint, "
                                 f"{tuple(value.global_shape)} in this run")
            items += create_read_items_for_chunk_list(fqn, md, value.chunks())
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, ShardedValue):
            assert index.index is not None  # create_read_items_for_chunk_list numbers pieces
            return value.pieces[index.index][1]
        return super().lookup_tensor(index)
