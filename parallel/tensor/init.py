"""Parallelism-invariant initialisation and slicing of full tensors.

docs/DESIGN.md, 'Parallelism-invariant initialisation'.

Every parameter is initialised as its FULL tensor on CPU from a generator seeded by
(seed, parameter name), then this rank keeps its slice. So any tp size and any pipeline
split gives bit-identical full weights; peak extra memory is one full parameter.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch

# How a partitioned dimension is made of stacked blocks, each split across tp on its own:
# k equal blocks (an int; 1 = one block), or the full sizes of unequal ones (GQA's q, k, v).
Stride = Union[int, Tuple[int, ...]]


@dataclass(frozen=True)
class InitSpec:
    """How to make a parameter's full tensor.

    kind: 'normal' (mean 0, `std`), 'zeros' or 'ones'. `valid_rows` (for padded vocab
    tables) draws only the first rows and leaves the padding rows zero, so the real rows do
    not depend on how much padding a tp size needs.
    """

    kind: str
    full_shape: Tuple[int, ...]
    std: float = 0.0
    valid_rows: Optional[int] = None


def name_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, name), stable across processes and versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_tensor(spec: InitSpec, seed: int, name: str) -> torch.Tensor:
    """The full fp32 CPU tensor described by `spec`, drawn from the (seed, name) generator."""
    if spec.kind == "zeros":
        return torch.zeros(spec.full_shape)
    if spec.kind == "ones":
        return torch.ones(spec.full_shape)
    if spec.kind != "normal":
        raise ValueError(f"unknown init kind {spec.kind!r}: use normal, zeros or ones")
    gen = torch.Generator().manual_seed(name_seed(seed, name))
    rows = spec.full_shape[0] if spec.valid_rows is None else spec.valid_rows
    drawn = torch.empty((rows,) + tuple(spec.full_shape[1:])).normal_(0.0, spec.std,
                                                                       generator=gen)
    if rows == spec.full_shape[0]:
        return drawn
    out = torch.zeros(spec.full_shape)
    out[:rows] = drawn
    return out


def _blocks(t: torch.Tensor, dim: int, stride: Stride, parts: int = 1) -> Sequence[torch.Tensor]:
    """The stacked blocks of `t` along `dim`; `parts` > 1 when `t` is one rank's slice."""
    if isinstance(stride, int):
        return t.chunk(stride, dim=dim)
    return t.split([size // parts for size in stride], dim=dim)


def shard(full: torch.Tensor, dim: int, rank: int, size: int, stride: Stride = 1) -> torch.Tensor:
    """This rank's slice of `full` along `dim`.

    With `stride` k the dimension holds k stacked blocks (e.g. SwiGLU's gate and up
    projections) and each rank gets its slice of every block, concatenated; a tuple gives
    the sizes of unequal blocks (a fused q, k, v with fewer key/value heads).
    """
    if size == 1:
        return full
    return torch.cat([b.chunk(size, dim=dim)[rank] for b in _blocks(full, dim, stride)],
                     dim=dim)


def unshard(parts: Sequence[torch.Tensor], dim: int, stride: Stride = 1) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every rank's slice (in rank order)."""
    if stride == 1:
        return torch.cat(list(parts), dim=dim)
    per_rank = [_blocks(p, dim, stride, len(parts)) for p in parts]
    blocks = range(len(per_rank[0]))
    return torch.cat([torch.cat([r[b] for r in per_rank], dim=dim) for b in blocks], dim=dim)


def set_parallel_attributes(param: torch.Tensor, spec: InitSpec,
                            partition_dim: Optional[int] = None, stride: Stride = 1,
                            sequence_parallel: bool = False) -> None:
    """Tag a parameter with its init spec and how it is split across tp.

    Megatron's idiom: the tags are attributes of the Parameter object itself, so they follow
    it through optimizers and state dicts; read them with getattr (torch does not declare them).
    """
    tags = {"init_spec": spec, "tensor_model_parallel": partition_dim is not None,
            "sequence_parallel": sequence_parallel, "shared_embedding": False}
    if partition_dim is not None:
        tags.update(partition_dim=partition_dim, partition_stride=stride)
    for key, value in tags.items():
        setattr(param, key, value)


def mark_shared_embedding(param: torch.Tensor, copy: bool = False) -> None:
    """Tag the word-embedding / output weight that the first and last stages keep in sync;
    `copy`: the last stage's copy of the word embedding (multi-token prediction's), which
    checkpoints save from the first stage only."""
    setattr(param, "shared_embedding", True)
    setattr(param, "shared_embedding_copy", copy)


@torch.no_grad()
def initialize_parameter(param: torch.nn.Parameter, seed: int, name: str, tp_rank: int,
                         tp_size: int) -> None:
    """Fill `param` with its slice of the name-seeded full tensor (no-op on meta)."""
    if param.is_meta:
        return
    full = full_tensor(getattr(param, "init_spec"), seed, name)
    if getattr(param, "tensor_model_parallel", False):
        full = shard(full, getattr(param, "partition_dim"), tp_rank, tp_size,
                     getattr(param, "partition_stride"))
    param.copy_(full.to(dtype=param.dtype))
