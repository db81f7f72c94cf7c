"""What the run asks of the machine, and what the machine has: said before start-up.

Two jobs, both before any process group exists:
- `device_notes`: which device and backend were chosen and why, and what the device cannot
  honour (a GPU-configured job on a machine without a usable GPU, bf16/fp16 on a CPU);
- `check_memory`: refuse a run whose estimated memory per rank exceeds what the device
  offers that rank (on a CPU, the host's RAM shared by the ranks of this node).

The estimate is a deliberate LOWER bound (weights, gradients, optimizer state as ZeRO shards
them, and the activations of the micro-batches 1F1B keeps in flight, by Megatron's
per-layer formula; no allocator slack, buffers or workspace), so a refused run could never
have fit; a run that passes may still run out of memory.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Mapping

import torch

if TYPE_CHECKING:
    from gigatron.training.config.run_config import RunConfig

GIB = 2 ** 30
# environment variables that only a GPU job sets (Megatron's example scripts export the first)
GPU_HINTS = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG",
             "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE")
LOCAL_WORLD_VARS = ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                    "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by what holds them (a lower bound: see the module docstring)."""

    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB (weights {self.weights / GIB:.1f}, gradients "
                f"{self.gradients / GIB:.1f}, optimizer {self.optimizer / GIB:.1f}, "
                f"activations {self.activations / GIB:.1f})")


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def estimate_memory(run: "RunConfig", parameters: int, device: torch.device) -> MemoryEstimate:
    """Lower bound of one rank's memory on `device` for `parameters` model parameters."""
    model, p, zero, t = run.model, run.parallel, run.zero, run.train
    assert t.micro_batch_size is not None  # resolved by arguments.build_run
    width = _dtype_bytes(model.params_dtype)
    local = parameters / (p.tp * p.pp)  # this rank's slice of the model
    stage = zero.zero_stage
    shards = p.dp * p.context_parallel_size  # ZeRO shards over the ranks sharing the model
    weights = local * width / (shards if stage >= 3 else 1)
    gradients = local * width / (shards if stage >= 2 else 1)
    # Adam keeps two fp32 moments; mixed precision adds the fp32 master copy
    per_param = (8 if zero.optimizer in ("adam", "adamw") else
                 4 if zero.sgd_momentum else 0) + (4 if width != 4 else 0)
    offloaded = zero.offload_optimizer == "cpu" and device.type != "cpu"
    optimizer = 0.0 if offloaded else local * per_param / (shards if stage >= 1 else 1)
    # context parallelism: each rank holds s / cp tokens of every micro-batch
    s, b, h = model.seq_length // p.context_parallel_size, t.micro_batch_size, model.hidden_size
    a = model.num_attention_heads
    per_layer: float
    if model.recompute_granularity == "full":
        per_layer = s * b * h * width  # only each layer's input is kept
    else:  # Megatron's 34 + 5as/h bytes per (token x hidden) at 2-byte activations
        per_layer = s * b * h * (34 + 5 * a * s / h) * width / 2 / p.tp
    layers = model.num_layers / p.pp
    in_flight = min(p.pp, t.num_microbatches)  # 1F1B: the first stage holds pp micro-batches
    return MemoryEstimate(weights, gradients, optimizer, per_layer * layers * in_flight)


def local_ranks(env: Mapping[str, str], world_size: int) -> int:
    """How many ranks share this node (the launcher says; else all of them)."""
    for name in LOCAL_WORLD_VARS:
        value = env.get(name, "")
        if value.split("(")[0].isdigit():  # SLURM writes "4(x2)" for uneven layouts
            return max(1, int(value.split("(")[0]))
    return world_size


def device_capacity(device: torch.device, ranks_here: int) -> float:
    """Bytes this rank can use: its GPU's memory, or its share of the host's RAM."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[1])
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return ram / max(ranks_here, 1)


def check_memory(estimate: MemoryEstimate, capacity: float, device: torch.device,
                 ranks_here: int) -> None:
    """Refuse, naming the numbers and the flags that lower them, when the run cannot fit."""
    if estimate.total <= capacity:
        return
    where = (f"{device.type} has {capacity / GIB:.1f} GiB" if device.type == "cuda" else
             f"this machine's RAM gives each of its {ranks_here} local rank"
             f"{'s' if ranks_here != 1 else ''} {capacity / GIB:.1f} GiB")
    raise ValueError(
        f"the run needs at least {estimate.describe()} per rank, but {where}: lower "
        f"--micro-batch-size or --seq-length, add --recompute-granularity full, shard with "
        f"--zero-stage, use more ranks (--tensor/--pipeline-model-parallel-size), or a "
        f"smaller model")


def device_notes(device: torch.device, backend: str, run: "RunConfig",
                 env: Mapping[str, str]) -> List[str]:
    """Lines saying which device and backend were chosen and what they cannot honour."""
    lines = [f"device: {_device_name(device)}, backend {backend}"]
    if device.type == "cpu":
        hints = [name for name in GPU_HINTS if env.get(name)]
        if hints:
            why = ("this torch has no CUDA" if torch.version.cuda is None else
                   "torch finds no GPU")
            lines.append(f"note: the job is set up for GPUs ({', '.join(hints)} set) but "
                         f"{why} ({torch.__version__}): running on the CPU with gloo, "
                         f"far slower")
        dtype = run.model.params_dtype if run.model is not None else torch.float32
        if dtype in (torch.bfloat16, torch.float16):
            name = "bf16" if dtype == torch.bfloat16 else "fp16"
            lines.append(f"note: --{name} on a CPU saves memory but is not faster than fp32 "
                         f"(no {name} matrix units assumed); drop --{name} for speed here")
    return lines


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({os.cpu_count()} cores)"


def check_run_fits(run: "RunConfig", device: torch.device, env: Mapping[str, str]) -> None:
    """`check_memory` for `run`'s GPT on `device` (runs without a model config pass)."""
    if run.model is None or run.train.micro_batch_size is None:
        return
    from gigatron.models.gpt import count_parameters

    ranks_here = local_ranks(env, run.parallel.world_size)
    check_memory(estimate_memory(run, count_parameters(run.model), device),
                 device_capacity(device, ranks_here), device, ranks_here)
