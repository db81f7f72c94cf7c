"""Device memory as a CUDA run reports it, on top of what its tensors need (memory/).

Three figures of one rank, each a superset of the one before:

  allocated  what the tensors hold at the peak: model state + activations + transient
             (memory/; `torch.cuda.max_memory_allocated`, the training log's "peak memory")
  reserved   what torch's caching allocator holds from the driver at that peak
             (`torch.cuda.max_memory_reserved`, what torchtitan logs as "memory"): allocated
             x (1 + FRAGMENTATION) + the cuBLAS workspaces, which it also serves
  device     what nvidia-smi shows and what must fit the card: reserved + the memory outside
             the allocator (CUDA context, kernel images, library handles: NON_PYTORCH_GIB) +
             NCCL's buffers (NCCL_GIB_PER_GROUP per communicator of more than one rank)

A layout fits when `device` fits the card's memory. Constants and their sources:
"""
from __future__ import annotations

from typing import Sequence

GIB = 2 ** 30

FRAGMENTATION = 0.10
"""Reserved over allocated at the peak, beyond 1: blocks the caching allocator has cached but
cannot reuse for the peak's request sizes (split and oversize blocks). Not measured by us:
an assumption, set while comparing with torchtitan's Table 1 (a calibration row of
published.py) and checked on its held-out Table 3. At an out-of-memory error the allocator
frees its cache first, so the H200 session's OOM line shows only 1.1% (1.44 of 133.05 GiB)."""

WORKSPACE_GIB = 1 / 16
"""cuBLAS/cuBLASLt workspaces, served by the caching allocator: torch's default
CUBLAS_WORKSPACE_CONFIG on Hopper, :4096:8 (32 MiB per handle and stream), and cuBLASLt's
own 32 MiB (PyTorch's CUDA semantics notes)."""

NON_PYTORCH_GIB = 2.44
"""Memory outside the allocator: measured on the H200 session (docs/PERFORMANCE.md, "One
H200"; bench/results/2026-11-26-h200/train_gpt3-1.3b_mb8.json): at the out-of-memory error,
136.93 GiB in use by the process, of which 133.05 allocated + 1.44 reserved by PyTorch, so
2.44 GiB of CUDA context, kernel images and library handles (torch 2.11, CUDA 13)."""

NCCL_GIB_PER_GROUP = 0.25
"""NCCL's buffers per communicator: NCCL_BUFFSIZE 4 MiB per channel and peer and protocol
(NCCL's environment-variable documentation), up to 32 channels on NVLink: ~0.25 GiB for a
ring. An estimate from those defaults, not a measurement."""


def reserved_bytes(allocated: float) -> float:
    """What torch's caching allocator reserves at an `allocated` peak."""
    return allocated * (1 + FRAGMENTATION) + WORKSPACE_GIB * GIB


def device_bytes(allocated: float, group_sizes: Sequence[int], on_gpu: bool) -> float:
    """What the process holds on the device (nvidia-smi) at an `allocated` peak, with one
    NCCL communicator per group size above 1 (the CPU: the allocated bytes alone)."""
    if not on_gpu:
        return allocated
    groups = sum(1 for size in group_sizes if size > 1)
    return reserved_bytes(allocated) + (NON_PYTORCH_GIB + NCCL_GIB_PER_GROUP * groups) * GIB
