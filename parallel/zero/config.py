"""ZeroConfig: every knob of the ZeRO optimizer wrapper, named as DeepSpeed / Megatron name it."""
from __future__ import annotations

from dataclasses import dataclass
import torch

_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_OPTIMIZERS = ("adamw", "adam", "sgd")


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

    optimizer: str = "adamw"
    """'adamw', 'adam' or 'sgd': torch.optim's implementation runs on the flat shard."""
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

    offload_optimizer: str = "none"
    """'cpu': fp32 master weights and optimizer state live (pinned on CUDA) in host memory
    and the step runs there (DeepSpeed offload_optimizer.device). Needs zero_stage >= 1."""
    grad_reduce_dtype: str = "fp32"
    """Dtype gradients travel in ('fp32', 'bf16', 'fp16'); they accumulate back in fp32."""
    grad_reduce_in_bf16: bool = False
    """Megatron's --grad-reduce-in-bf16: same as grad_reduce_dtype='bf16'."""

    def __post_init__(self) -> None:
        if self.use_distributed_optimizer and self.zero_stage == 0:
            self.zero_stage = 1
        if self.grad_reduce_in_bf16:
            self.grad_reduce_dtype = "bf16"
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError naming the bad field and the fix."""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.reduce_bucket_size < 1:
            raise ValueError(f"reduce_bucket_size must be a positive element count, got "
                             f"{self.reduce_bucket_size!r}")
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r} is not supported: use one of "
                             f"{', '.join(_OPTIMIZERS)}")
        if self.offload_optimizer not in ("none", "cpu"):
            raise ValueError(f"offload_optimizer must be 'none' or 'cpu', got "
                             f"{self.offload_optimizer!r}")
        if self.offload_optimizer == "cpu" and self.zero_stage < 1:
            raise ValueError("offload_optimizer='cpu' needs zero_stage >= 1 (the offloaded "
                             "state is the sharded optimizer state): set zero_stage to 1-3")
        if self.grad_reduce_dtype not in _REDUCE_DTYPES:
            raise ValueError(f"grad_reduce_dtype must be one of {sorted(_REDUCE_DTYPES)}, got "
                             f"{self.grad_reduce_dtype!r}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0 (0 disables clipping), got "
                             f"{self.clip_grad!r}")
        if self.loss_scale < 0:
            raise ValueError(f"loss_scale must be >= 0 (0 = dynamic), got {self.loss_scale!r}")
        if self.loss_scale_window < 1 or self.hysteresis < 1:
            raise ValueError("loss_scale_window and hysteresis must be >= 1, got "
                             f"{self.loss_scale_window!r} and {self.hysteresis!r}")
        if self.min_loss_scale <= 0:
            raise ValueError(f"min_loss_scale must be > 0, got {self.min_loss_scale!r}")

    @property
    def reduce_dtype(self) -> torch.dtype:
        return _REDUCE_DTYPES[self.grad_reduce_dtype]

    @classmethod
    def from_deepspeed(cls, ds: dict, **overrides) -> "ZeroConfig":
        """Read the `zero_optimization`, `fp16` and `gradient_clipping` parts of a DeepSpeed
        JSON config; unknown keys in those sections are errors."""
        kw = {field: value for field, (_, value) in deepspeed_fields(ds).items()}
        kw.update(overrides)
        return cls(**kw)


# DeepSpeed JSON key -> ZeroConfig field: the ONE mapping of these sections (pretrain_gpt.py's
# --deepspeed-config reads them through deepspeed_fields too).
DEEPSPEED_ZERO_KEYS = {"stage": "zero_stage", "reduce_bucket_size": "reduce_bucket_size",
                       "overlap_comm": "overlap_comm", "offload_optimizer": "offload_optimizer"}
DEEPSPEED_FP16_KEYS = {key: key for key in (
    "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale")}
_OFFLOAD_KEYS = ("device", "pin_memory")


def _section(ds: dict, name: str) -> dict:
    section = ds.get(name, {})
    if not isinstance(section, dict):
        raise ValueError(f"{name} must be a JSON object, got {section!r}")
    return section


def _offload_device(offload) -> str:
    """offload_optimizer {device, pin_memory} -> 'cpu' or 'none'."""
    if not isinstance(offload, dict):
        raise ValueError(f"zero_optimization.offload_optimizer must be a JSON object like "
                         f'{{"device": "cpu"}}, got {offload!r}')
    for key in offload:
        if key not in _OFFLOAD_KEYS:
            raise ValueError(f"zero_optimization.offload_optimizer.{key} is not supported; "
                             f"known keys: {list(_OFFLOAD_KEYS)}")
    if offload.get("pin_memory", True) is not True:
        raise ValueError("zero_optimization.offload_optimizer.pin_memory false is not "
                         "supported: offloaded state is always pinned on CUDA (set it to true "
                         "or drop it)")
    return offload.get("device", "none")


def deepspeed_fields(ds: dict) -> dict:
    """ZeroConfig field -> (DeepSpeed key, value) for the `zero_optimization`, `fp16` (all but
    `enabled`) and `gradient_clipping` entries present in `ds`; unknown keys are errors."""
    out: dict = {}
    for key, value in _section(ds, "zero_optimization").items():
        if key not in DEEPSPEED_ZERO_KEYS:
            raise ValueError(f"zero_optimization.{key} is not supported; known keys: "
                             f"{sorted(DEEPSPEED_ZERO_KEYS)}")
        if key == "offload_optimizer":
            value = _offload_device(value)
        elif key == "reduce_bucket_size" and isinstance(value, float) and value.is_integer():
            value = int(value)  # DeepSpeed configs often write 5e8
        out[DEEPSPEED_ZERO_KEYS[key]] = (f"zero_optimization.{key}", value)
    for key, value in _section(ds, "fp16").items():
        if key == "enabled":
            continue
        if key not in DEEPSPEED_FP16_KEYS:
            raise ValueError(f"fp16.{key} is not supported; known keys: "
                             f"{['enabled'] + list(DEEPSPEED_FP16_KEYS)}")
        out[DEEPSPEED_FP16_KEYS[key]] = (f"fp16.{key}", value)
    if "gradient_clipping" in ds:
        out["clip_grad"] = ("gradient_clipping", float(ds["gradient_clipping"]))
    return out
