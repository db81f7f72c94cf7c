"""The run's settings, one dataclass per concern, filled from the flags by `arguments.py`.

The model's settings are `gigatron.models.config.TransformerConfig` (owned by the model);
everything else a training run needs lives here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


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
    zero_stage: int = 0
    ddp_bucket_size: Optional[int] = None
    grad_reduce_in_bf16: bool = False
    optimizer_cpu_offload: bool = False
    distributed_timeout_minutes: float = 10.0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer, mixed precision, loss scaling (DeepSpeed's knobs) and clipping."""

    optimizer: str = "adam"  # Megatron's 'adam' is AdamW (decoupled weight decay)
    lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None  # static scale when set (fp16)
    initial_loss_scale: float = 2.0 ** 16
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    @property
    def params_dtype(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


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
class DataConfig:
    """Where samples come from (the data flags of Megatron) and how they are tokenized."""

    data_path: Optional[List[str]] = None
    split: str = "969,30,1"
    train_data_path: Optional[List[str]] = None
    valid_data_path: Optional[List[str]] = None
    test_data_path: Optional[List[str]] = None
    mock_data: bool = False
    data_cache_path: Optional[str] = None
    tokenizer_type: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    eod_mask_loss: bool = False
    num_workers: int = 0
    seq_length: int = 1024
    seed: int = 1234


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
    optimizer: OptimizerConfig
    lr_schedule: LRScheduleConfig
    data: DataConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    flags: Dict[str, Any] = field(default_factory=dict)  # the parsed flags, for checkpoints
