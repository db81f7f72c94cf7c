"""Optimizers as a DeepSpeed config names them, built over ZeRO's flat master shards.

`OptimizerSpec` is the contract between the config reader (which fills it with DeepSpeed's
defaults) and ZeRO (which builds the torch optimizer over this rank's master shards).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Tuple

# DeepSpeed's optimizer "type" names (case-insensitive) this module builds
OPTIMIZER_TYPES = ("adam", "adamw", "sgd", "lamb", "adagrad")


@dataclass
class OptimizerSpec:
    """One optimizer with DeepSpeed's defaults: what `"optimizer": {"type", "params"}` says."""

    type: str  # one of OPTIMIZER_TYPES, lower case
    lr: float = 1e-3
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0  # DeepSpeed's default: none unless the config gives it
    adam_w_mode: bool = True  # DeepSpeed's Adam decouples weight decay (AdamW) unless False
    torch_adam: bool = False  # use torch.optim's Adam/AdamW (numerically the same here)
    momentum: float = 0.0  # SGD
    dampening: float = 0.0  # SGD
    nesterov: bool = False  # SGD
    initial_accumulator_value: float = 0.0  # Adagrad
    lr_decay: float = 0.0  # Adagrad
    max_coeff: float = 10.0  # Lamb: bounds of the trust ratio
    min_coeff: float = 0.01
    extra: Dict[str, Any] = field(default_factory=dict)  # other params, passed through
