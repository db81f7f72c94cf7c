"""Which parameters Muon updates, the matrices they are made of, and one matrix's update.

As Megatron-Core: every trainable 2-D weight except the word embedding and the output layer
(tagged `is_embedding_or_output_parameter`, or the tied copy of a last pipeline stage) is a
matrix; the rest (norms, biases, embeddings; stacked expert biases [E, n], one bias per expert
in Megatron-Core) go to the scalar optimizer. A stacked expert
weight [experts, in, out] (models/moe/experts.py's layout, x @ W) is one matrix per expert,
each orthogonalised on its own, as Megatron-Core's per-expert weights are. A fused qkv weight
(named `linear_qkv.weight`, rows grouped per query group as Megatron's) is split into its q, k
and v rows unless --muon-no-split-qkv.

Tensor parallelism: a matrix split over tp (its `partition_dim` and stride; an expert's ffn
over expert-tp) is gathered whole, orthogonalised and cut back to this rank's shard in the
'duplicated' mode (every tp rank computes the same whole matrix: equal to one device), or
orthogonalised shard by shard in 'blockwise' (no communication; each shard normalised and
scaled by its own shape, so the update depends on the tp size, as Megatron-Core's blockwise),
or kept sharded in 'distributed' (the norm and every Gram matrix summed over tp, the split
dimension the contracted one: equal to one device up to the sums' rounding, each rank
computing its columns; the Gram matrix is the split dimension's square, whichever side is
smaller, as Megatron-Core's).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.tensor.init import Stride, shard, unshard
from gigatron.parallel.zero.muon.config import MuonConfig
from gigatron.parallel.zero.param_groups import NO_DECAY_ATTR
from gigatron.parallel.zero.muon.newton_schulz import (newton_schulz, newton_schulz_flops,
                                                       scale_factor, split_rows)

EMBEDDING_OR_OUTPUT = "is_embedding_or_output_parameter"  # Megatron-Core's tag
QKV_NAME = "linear_qkv.weight"


@dataclass(frozen=True)
class TensorSplit:
    """How a matrix is cut over tensor parallelism: along `dim` of the stored matrix."""

    dim: int
    stride: Stride = 1
    expert: bool = False  # over the expert-tensor-parallel group, else the tp group


@dataclass(frozen=True)
class MatrixUnit:
    """One matrix Muon orthogonalises: elements [offset, offset + rows x cols) of a parameter
    (flattened), stored [rows, cols]; `input_major` when stored [in, out]."""

    param: int
    offset: int
    rows: int
    cols: int
    input_major: bool = False
    qkv: Optional[Tuple[int, ...]] = None
    split: Optional[TensorSplit] = None

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    def flops(self, steps: int) -> int:
        """Newton-Schulz FLOPs of this rank's piece (its cost for load balancing)."""
        return newton_schulz_flops(self.rows, self.cols, steps)


def is_muon_matrix(param: torch.Tensor) -> bool:
    """Whether Muon (not the scalar optimizer) updates `param`."""
    if getattr(param, EMBEDDING_OR_OUTPUT, False) or getattr(param, "shared_embedding", False) \
            or getattr(param, NO_DECAY_ATTR, False):  # stacked expert biases [E, n]
        return False
    return param.dim() in (2, 3) and bool(getattr(param, "use_muon", True))


def matrix_units(index: int, param: torch.Tensor, name: str,
                 config: MuonConfig) -> List[MatrixUnit]:
    """The matrices of parameter number `index` of its group (named `name`)."""
    if param.dim() == 3:  # stacked experts [E, in, out]
        experts, rows, cols = param.shape
        split = _expert_split(param)
        return [MatrixUnit(index, e * rows * cols, rows, cols, True, None, split)
                for e in range(experts)]
    rows, cols = param.shape
    qkv = config.qkv_split_shapes if config.split_qkv and name.endswith(QKV_NAME) else None
    split = None
    if getattr(param, "tensor_model_parallel", False):
        split = TensorSplit(int(getattr(param, "partition_dim")),
                            getattr(param, "partition_stride", 1))
    return [MatrixUnit(index, 0, rows, cols, False, None if qkv is None else tuple(qkv), split)]


def _expert_split(param: torch.Tensor) -> Optional[TensorSplit]:
    for dim, _, size, stride in getattr(param, "expert_splits", ()):
        if dim != 0 and size > 1:  # dim 0 (experts over ep) is whole matrices
            return TensorSplit(dim - 1, stride, expert=True)
    return None


class MatrixUpdate:
    """Orthogonalise-and-scale, with the groups a 'duplicated' matrix is gathered over."""

    def __init__(self, config: MuonConfig, tp_group: Group = None,
                 expert_tp_group: Group = None) -> None:
        self.config, self.tp_group, self.expert_tp_group = config, tp_group, expert_tp_group

    def __call__(self, unit: MatrixUnit, matrix: torch.Tensor) -> torch.Tensor:
        """The scaled orthogonal update of `matrix` ([rows, cols] as stored, this rank's)."""
        mode = self.config.tp_mode
        split = unit.split if mode != "blockwise" else None
        group = None if split is None else \
            (self.expert_tp_group if split.expert else self.tp_group)
        if split is None or comm.group_size(group) == 1:
            return self._whole(unit, matrix.float())
        if mode == "distributed":  # the shard stays; norms and Gram matrices summed over tp
            # the split dimension of the [out, in] view
            dim = 1 - split.dim if unit.input_major else split.dim
            return self._whole(unit, matrix.float(), Sharded(group, dim))
        out = self._whole(unit, _gather(matrix, split, group).float())
        return shard(out, split.dim, comm.group_rank(group), comm.group_size(group),
                     split.stride)

    def _whole(self, unit: MatrixUnit, matrix: torch.Tensor,
               sharded: Optional["Sharded"] = None) -> torch.Tensor:
        x = matrix.mT if unit.input_major else matrix  # [out, in]
        rows, cols = x.shape
        if unit.qkv is None:
            out = self._scaled(x, sharded)
        else:
            groups = split_rows(rows, unit.qkv)
            pieces = x.reshape(groups, sum(unit.qkv), cols).split(list(unit.qkv), dim=1)
            out = torch.cat([self._scaled(p.reshape(-1, cols), sharded).view(groups, -1, cols)
                             for p in pieces], dim=1).view(rows, cols)
        return out.mT if unit.input_major else out

    def _scaled(self, x: torch.Tensor, sharded: Optional["Sharded"] = None) -> torch.Tensor:
        c = self.config
        rows, cols = x.shape
        if sharded is None:
            out = newton_schulz(x, c.num_ns_steps, c.coefficient_type, c.fp32_matmul_prec)
        else:  # the split dimension contracted in every Gram matrix
            n = comm.group_size(sharded.group)
            rows, cols = (rows * n, cols) if sharded.dim == 0 else (rows, cols * n)
            out = newton_schulz(x, c.num_ns_steps, c.coefficient_type, c.fp32_matmul_prec,
                                distributed=True, group=sharded.group,
                                tall=sharded.dim == 0)
        return out * (scale_factor(rows, cols, c.scale_mode) * c.extra_scale_factor)


@dataclass(frozen=True)
class Sharded:
    """A matrix left sharded over `group` along `dim` of its [out, in] view."""

    group: Group
    dim: int


def _gather(matrix: torch.Tensor, split: TensorSplit, group: Group) -> torch.Tensor:
    """The whole matrix from every rank's shard (in group order, strided blocks rejoined)."""
    n = comm.group_size(group)
    moved = matrix.movedim(split.dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=moved.dtype,
                      device=moved.device)
    comm.all_gather(out, moved, group=group)
    parts = [p.movedim(0, split.dim) for p in out.chunk(n, dim=0)]
    return unshard(parts, split.dim, split.stride)


def units_of(params: Sequence[torch.Tensor], names: Dict[int, str],
             config: MuonConfig) -> List[MatrixUnit]:
    """Every matrix of `params` (a flat group's, all Muon's), in parameter order."""
    return [u for i, p in enumerate(params)
            for u in matrix_units(i, p, names.get(id(p), ""), config)]
