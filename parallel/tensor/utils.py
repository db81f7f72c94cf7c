"""Helpers around tensor-parallel parameters: gather to full shape, SP grad reduction."""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from gigatron.parallel import comm
from gigatron.parallel.tensor.init import unshard
from gigatron.parallel.tensor.mappings import tp_size
from gigatron.parallel.comm import Group


def divide(numerator: int, denominator: int, what: str) -> int:
    """Exact division, or a ValueError naming `what`."""
    if numerator % denominator:
        raise ValueError(f"{what}: {numerator} is not divisible by {denominator}")
    return numerator // denominator


def gather_full_parameter(param: torch.Tensor, tp_group: Group = None,
                          data: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The full (unsharded) tensor of `param`, or of `data` shaped like it (e.g. its grad).

    Replicated parameters come back as a detached copy. Every tp rank must call this.
    """
    local = (param if data is None else data).detach()
    if not getattr(param, "tensor_model_parallel", False):
        return local.clone()
    n = tp_size(tp_group)
    if n == 1:
        return local.clone()
    dim: int = getattr(param, "partition_dim")
    moved = local.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0],) + tuple(moved.shape[1:]), dtype=moved.dtype,
                      device=moved.device)
    comm.all_gather(out, moved, group=tp_group)
    parts = [p.movedim(0, dim) for p in out.chunk(n, dim=0)]
    return unshard(parts, dim, getattr(param, "partition_stride", 1))


def allreduce_sequence_parallel_grads(params: Iterable[torch.nn.Parameter],
                                      tp_group: Group = None) -> None:
    """Sum over tp the grads of parameters marked `sequence_parallel` (norms, row biases).

    Under sequence parallelism each tp rank saw only its slice of the sequence, so these
    replicated parameters hold partial grads. One flat all-reduce for all of them.
    """
    grads = [p.grad for p in params
             if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or tp_size(tp_group) == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=tp_group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
