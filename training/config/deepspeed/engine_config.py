"""EngineConfig: what a DeepSpeed JSON config tells `gigatron.initialize`, resolved.

The reader (`gigatron.training.config.deepspeed.engine.engine_config`) fills it with DeepSpeed's
meanings and defaults; the engine only reads it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from gigatron.parallel.zero.config import ZeroConfig
from gigatron.parallel.zero.optimizers import OptimizerSpec


@dataclass
class SchedulerSpec:
    """`"scheduler": {"type": "WarmupLR", "params": {...}}` (DeepSpeed's names)."""

    type: str  # WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest
    params: Dict[str, Any] = field(default_factory=dict)


@dataclass
class EngineConfig:
    """A DeepSpeed config, resolved: batch triple consistent, "auto" filled, defaults applied."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    # stage, buckets, overlap, offload, gradient_clipping (clip_grad), loss scaling (fp16
    # section), grad_reduce_dtype (communication_data_type); its optimizer fields are unused
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    precision: str = "fp32"  # 'fp32', 'fp16' or 'bf16'
    fp16_auto_cast: bool = False
    optimizer: Optional[OptimizerSpec] = None  # None: the caller passes one
    scheduler: Optional[SchedulerSpec] = None
    steps_per_print: int = 10
    wall_clock_breakdown: bool = False
    prescale_gradients: bool = False
    gradient_predivide_factor: float = 1.0
    zero_allow_untested_optimizer: bool = False
    tensorboard_dir: Optional[str] = None  # tensorboard.output_path/job_name when enabled
    csv_dir: Optional[str] = None
    wandb_project: Optional[str] = None  # wandb.project when wandb.enabled
    wandb_group: Optional[str] = None
    wandb_team: Optional[str] = None
    dataloader_drop_last: bool = False  # the training_dataloader drops a last partial batch
    activation_checkpointing: Dict[str, Any] = field(default_factory=dict)
    checkpoint: Dict[str, Any] = field(default_factory=dict)
    auto_cast_inputs: bool = False  # gigatron's extension: move/cast batches to the engine
    info: List[str] = field(default_factory=list)  # one line per accepted speed-only key
    resolved: Dict[str, Any] = field(default_factory=dict)  # the JSON with "auto" filled in
