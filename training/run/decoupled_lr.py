"""--decoupled-lr / --decoupled-min-lr: Megatron-Core's own learning rate for the input
embedding and the output layer.

In Megatron-Core the word-embedding weight (first stage) and the output-layer weight (last
stage) are tagged `is_embedding_or_output_parameter`; with --decoupled-lr their optimizer
groups get max_lr = --decoupled-lr and, when given, min_lr = --decoupled-min-lr (else
--min-lr), and the scheduler computes their lr with the same schedule shape (warm-up from
--lr-warmup-init, the decay style and lengths) from those two values. With tied embeddings
the one shared weight is in that group (on the first stage as the embedding, on the last
as the output layer's copy). Position embeddings, norms and the transformer layers keep
--lr. --decoupled-min-lr without --decoupled-lr has no effect (Megatron ignores it too; the
banner says so).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, List, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    import torch

    from gigatron.training.config.run_config import LRScheduleConfig
    from gigatron.training.config.validation import Problems


@dataclass(frozen=True)
class DecoupledLRSettings:
    """Megatron's separate learning rate for the embedding and output layer weights."""

    decoupled_lr: Optional[float] = setting(
        None, "peak learning rate of the input embedding and output layer weights (the same "
        "schedule as --lr; tied embeddings: the shared weight)", "--decoupled-lr")
    decoupled_min_lr: Optional[float] = setting(
        None, "final learning rate of those weights (default --min-lr; only with "
        "--decoupled-lr)", "--decoupled-min-lr")


def decoupled_schedule(schedule: "LRScheduleConfig",
                       settings: DecoupledLRSettings) -> Optional["LRScheduleConfig"]:
    """The decoupled groups' schedule: `schedule` with --decoupled-lr as its max_lr and
    --decoupled-min-lr (else --min-lr) as its min_lr; None without --decoupled-lr."""
    if settings.decoupled_lr is None:
        return None
    min_lr = settings.decoupled_min_lr
    return replace(schedule, max_lr=settings.decoupled_lr,
                   min_lr=schedule.min_lr if min_lr is None else min_lr)


def set_decoupled_lr(optimizer: "torch.optim.Optimizer", step: int,
                     schedule: "LRScheduleConfig",
                     settings: DecoupledLRSettings) -> Optional[float]:
    """After the loop set every group's lr from `schedule`: the decoupled groups' lr at
    `step` (x their lr_mult, as Megatron); returns it (None without --decoupled-lr)."""
    from gigatron.training.lr.megatron import learning_rate

    cfg = decoupled_schedule(schedule, settings)
    if cfg is None:
        return None
    lr = learning_rate(step, cfg)
    for group in optimizer.param_groups:
        if group.get("is_decoupled_lr"):
            group["lr"] = lr * group.get("lr_mult", 1.0)
    return lr


def check_decoupled_lr(settings: DecoupledLRSettings, p: "Problems") -> None:
    """Negative learning rates (a decoupled min above the decoupled max is allowed: Megatron
    asserts min <= max for --lr/--min-lr only)."""
    for name, value in (("--decoupled-lr", settings.decoupled_lr),
                        ("--decoupled-min-lr", settings.decoupled_min_lr)):
        if value is not None and value < 0:
            p.add(f"{name} must be >= 0, got {value}")


def decoupled_lr_notes(settings: DecoupledLRSettings) -> List[str]:
    """The banner's line for --decoupled-min-lr without --decoupled-lr."""
    if settings.decoupled_min_lr is not None and settings.decoupled_lr is None:
        return ["--decoupled-min-lr without --decoupled-lr: no effect (as in Megatron)"]
    return []
