"""ZeroConfig: every knob of the ZeRO optimizer wrapper, named as DeepSpeed / Megatron name it."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, List, Mapping, Optional

import torch

from gigatron.parallel.zero.loss_scaler import RULES
from gigatron.parallel.zero.muon.config import MuonConfig

_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_OPTIMIZERS = ("adamw", "adam", "sgd", "muon")


@dataclass
class ZeroConfig:
    """Data-parallel optimizer settings (DeepSpeed `zero_optimization` / `fp16` names)."""

    zero_stage: int = 0
    """0 = plain data parallel, 1 = shard fp32 master + optimizer state, 2 = also grads,
    3 = also parameters (gathered per layer just in time)."""
    use_distributed_optimizer: bool = False
    """Megatron's name for stage 1: when set, a zero_stage of 0 becomes 1."""
    reduce_bucket_size: int = 500_000_000
    """Elements per gradient bucket; a bucket is reduced as soon as all its grads exist."""
    overlap_comm: bool = True
    """Launch bucket reductions from backward hooks (False: all at finish_sync)."""
    stage3_prefetch: bool = True
    """Stage 3: gather the next layer's parameters while this layer computes."""
    overlap_param_gather: bool = False
    """Stages 1-2: the step launches the updated parameters' all-gathers and returns; the
    next forward waits for each bucket just before its first use (param_gather.py)."""

    optimizer: str = "adamw"
    """'adamw', 'adam' or 'sgd': torch.optim's implementation runs on the flat shard; 'muon':
    Muon on the matrices, AdamW on the rest (muon/)."""
    muon: Optional[MuonConfig] = None
    """Muon's settings under optimizer 'muon' (None: Megatron-LM's defaults)."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    """Applied to weights with 2+ dims; biases and norm weights get none."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.0
    clip_grad: float = 0.0
    """Clip the global grad norm to this value (Megatron --clip-grad; DeepSpeed
    gradient_clipping); 0 disables clipping. The norm is computed either way."""

    loss_scale: float = 0.0
    """fp16 only: > 0 is a static scale; 0 means dynamic loss scaling."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power."""
    loss_scale_window: int = 1000
    """Clean steps (no overflow) after which the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale is halved (DeepSpeed's delayed shift)."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis budget on every clean step (DeepSpeed, default off)."""
    min_loss_scale: float = 1.0
    loss_scale_rule: str = "megatron"
    """When the dynamic scale grows back: 'megatron' (Megatron-Core's, pretrain_gpt.py) or
    'deepspeed' (DeepSpeed's, one clean step later; gigatron.initialize): loss_scaler.py."""

    offload_optimizer: str = "none"
    """'cpu': fp32 master weights and optimizer state live in host memory and the step runs
    there, streamed bucket by bucket (offload.py; DeepSpeed offload_optimizer.device).
    Needs zero_stage >= 1."""
    offload_bucket_size: int = 32_000_000
    """Elements per bucket of the offloaded step: two fp32 grad buffers and two weight
    buffers of this size are the host memory it adds to the 12 bytes per parameter."""
    grad_reduce_dtype: str = "fp32"
    """Dtype gradients are accumulated and reduced in ('fp32', 'bf16', 'fp16'): the grad
    buffers' dtype and the wire's, as Megatron-Core's grad buffer (fp32 with
    grad_reduce_in_fp32, else the parameters' dtype); the optimizer steps fp32 copies."""
    grad_reduce_in_bf16: bool = False
    """Megatron's --grad-reduce-in-bf16: same as grad_reduce_dtype='bf16'."""

    def __post_init__(self) -> None:
        if self.use_distributed_optimizer and self.zero_stage == 0:
            self.zero_stage = 1
        if self.grad_reduce_in_bf16:
            self.grad_reduce_dtype = "bf16"
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError listing every bad field (one per line) and its fix."""
        problems = zero_problems(vars(self))
        if problems:
            raise ValueError("\n".join(problems))

    @property
    def reduce_dtype(self) -> torch.dtype:
        return _REDUCE_DTYPES[self.grad_reduce_dtype]


def zero_problems(values: Mapping[str, Any],
                  names: Optional[Mapping[str, str]] = None) -> List[str]:
    """Every bad ZeroConfig value in `values` (field -> value), one line each naming the
    field as `names` spells it (a flag or JSON key; default the field name) and the fix.
    The one place these rules live: ZeroConfig and pretrain_gpt.py's validation both use it."""
    def n(field: str) -> str:
        return (names or {}).get(field, field)

    v = {**_DEFAULTS, **values}
    rules = [
        (v["zero_stage"] in (0, 1, 2, 3),
         f"{n('zero_stage')} must be 0, 1, 2 or 3, got {v['zero_stage']!r}"),
        (v["reduce_bucket_size"] >= 1,
         f"{n('reduce_bucket_size')} must be a positive element count, got "
         f"{v['reduce_bucket_size']!r}"),
        (v["optimizer"] in _OPTIMIZERS,
         f"{n('optimizer')} {v['optimizer']!r} is not supported: use one of "
         f"{', '.join(_OPTIMIZERS)}"),
        (v["offload_optimizer"] in ("none", "cpu"),
         f"{n('offload_optimizer')} must be 'none' or 'cpu', got {v['offload_optimizer']!r}"),
        (v["offload_bucket_size"] >= 1,
         f"{n('offload_bucket_size')} must be a positive element count, got "
         f"{v['offload_bucket_size']!r}"),
        (v["offload_optimizer"] != "cpu" or v["optimizer"] != "muon",
         f"{n('offload_optimizer')} is not built with {n('optimizer')} muon (Newton-Schulz on "
         f"host shards): leave it off"),
        (v["offload_optimizer"] != "cpu" or v["zero_stage"] not in (0, None),
         f"{n('offload_optimizer')} needs a sharded optimizer (the offloaded state is the "
         f"sharded optimizer state): set {n('zero_stage')} to 1, 2 or 3"),
        (v["grad_reduce_dtype"] in _REDUCE_DTYPES,
         f"{n('grad_reduce_dtype')} must be one of {sorted(_REDUCE_DTYPES)}, got "
         f"{v['grad_reduce_dtype']!r}"),
        (v["clip_grad"] >= 0,
         f"{n('clip_grad')} must be >= 0 (0 disables clipping), got {v['clip_grad']!r}"),
        (v["weight_decay"] >= 0, f"{n('weight_decay')} must be >= 0, got {v['weight_decay']!r}"),
        (v["loss_scale"] >= 0, f"{n('loss_scale')} must be >= 0 (0 = dynamic), got "
                               f"{v['loss_scale']!r}"),
        (v["loss_scale_window"] >= 1,
         f"{n('loss_scale_window')} must be >= 1, got {v['loss_scale_window']!r}"),
        (v["hysteresis"] >= 1, f"{n('hysteresis')} must be >= 1, got {v['hysteresis']!r}"),
        (v["loss_scale_rule"] in RULES,
         f"{n('loss_scale_rule')} must be one of {', '.join(RULES)}, got "
         f"{v['loss_scale_rule']!r}"),
        (v["min_loss_scale"] > 0,
         f"{n('min_loss_scale')} must be > 0, got {v['min_loss_scale']!r}"),
    ]
    rules += [(0.0 <= v[b] < 1.0, f"{n(b)} must be in [0, 1), got {v[b]!r}")
              for b in ("adam_beta1", "adam_beta2")]
    return [message for ok, message in rules if not ok]


_DEFAULTS = {f.name: f.default for f in fields(ZeroConfig)}


def megatron_grad_dtype(params: str, accumulate_allreduce_grads_in_fp32: bool,
                        grad_reduce_in_bf16: bool) -> str:
    """The dtype Megatron-LM accumulates and reduces gradients in, for parameters in `params`
    ('fp32', 'fp16' or 'bf16'): fp32 under --accumulate-allreduce-grads-in-fp32, which --bf16
    turns on unless --grad-reduce-in-bf16 (which then turns it off), else the parameters'
    dtype (megatron/training/arguments.py validate_args; training.py passes the flag as
    DistributedDataParallelConfig.grad_reduce_in_fp32, whose grad buffers are fp32 if set,
    else the parameters' dtype: megatron/core/distributed/distributed_data_parallel.py)."""
    if params == "bf16":
        return "bf16" if grad_reduce_in_bf16 else "fp32"
    return "fp32" if accumulate_allreduce_grads_in_fp32 else params


def zero3_pipeline_problem(zero_stage: int, pipeline_stages: int, stage_name: str,
                           stages_name: str) -> Optional[str]:
    """The line refusing ZeRO stage 3 over more than one pipeline stage (or model chunk),
    naming the two settings as the caller's users know them; None when they can run together.
    The one home of this rule: pretrain_gpt.py's validation, `gigatron.initialize` and
    ZeroOptimizer call it."""
    if zero_stage != 3 or pipeline_stages <= 1:
        return None
    return (f"{stage_name} 3 needs {stages_name} 1, got {pipeline_stages}: a pipeline stage "
            f"runs many micro-batches' forwards before their backwards, so ZeRO-3 would "
            f"re-gather every layer per micro-batch in both directions to save memory the "
            f"pipeline already divides (DeepSpeed refuses it too): use {stage_name} 0, 1 or 2")
