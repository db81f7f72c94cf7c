"""The run's settings, one dataclass per concern, filled from the flags by `arguments.py`.

Concerns with an owner elsewhere use the owner's config: the model's
`gigatron.models.config.TransformerConfig`, the optimizer's (ZeRO stage, optimizer, loss
scaling, clipping) `gigatron.parallel.zero.ZeroConfig`, the data's
`gigatron.data.GPTDataConfig`. What only a training run needs lives here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional


@dataclass(frozen=True)
class ParallelConfig:
    """How the ranks split the work (Megatron's parallelism flags plus our --zero-stage)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    decoder_first_pipeline_num_layers: Optional[int] = None
    decoder_last_pipeline_num_layers: Optional[int] = None
    distributed_timeout_minutes: float = 10.0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class LRScheduleConfig:
    """Learning-rate schedule in Megatron's units: steps count samples, not iterations."""

    max_lr: float
    min_lr: float = 0.0
    decay_style: str = "linear"  # linear|cosine|constant|inverse-square-root|WSD
    warmup_steps: int = 0
    decay_steps: int = 1
    init_lr: float = 0.0  # lr at step 0 of warm-up (Megatron's --lr-warmup-init)
    wsd_decay_steps: Optional[int] = None
    wsd_decay_style: str = "exponential"  # linear|cosine|exponential|minus_sqrt


@dataclass(frozen=True)
class TrainConfig:
    """The loop: iterations, batches, evaluation cadence and exit conditions."""

    train_iters: int
    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 100
    skip_test: bool = False
    exit_interval: Optional[int] = None
    exit_signal_handler: bool = False
    num_workers: int = 0  # data-loader worker processes per rank


@dataclass(frozen=True)
class CheckpointConfig:
    """--save/--load and what a load restores."""

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    ckpt_format: str = "torch"  # torch|safetensors


@dataclass(frozen=True)
class LoggingConfig:
    """Where the metrics go: console every --log-interval, JSON lines, TensorBoard."""

    log_interval: int = 100
    metrics_file: Optional[str] = None
    tensorboard_dir: Optional[str] = None
    peak_tflops: Optional[float] = None  # override the per-device peak table for MFU
    progress: Optional[bool] = None  # None: on when stderr is a terminal
    timing_log_level: int = 0  # >= 1: synchronise the accelerator around timed phases


@dataclass
class RunConfig:
    """Everything one run needs, built once from the flags and handed down explicitly."""

    model: Any  # gigatron.models.config.TransformerConfig
    model_name: Optional[str]
    parallel: ParallelConfig
    zero: Any  # gigatron.parallel.zero.ZeroConfig: stage, optimizer, loss scaling, clipping
    lr_schedule: LRScheduleConfig
    data: Any  # gigatron.data.GPTDataConfig (eod and vocab filled from the tokenizer)
    train: TrainConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    flags: Dict[str, Any] = field(default_factory=dict)  # the parsed flags, for checkpoints
