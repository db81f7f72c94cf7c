"""`"auto"` values of a DeepSpeed config, filled as Hugging Face's Trainer fills them.

Hugging Face (transformers.integrations.deepspeed, `HfTrainerDeepSpeedConfig`) writes "auto"
for the keys its TrainingArguments decide: batch sizes, gradient_clipping, the optimizer's
lr/betas/eps/weight_decay, the warm-up scheduler's params, fp16/bf16 enabled, and the ZeRO
bucket sizes it derives from the model's hidden size. Here they come from `args` when it has
TrainingArguments' attribute (per_device_train_batch_size, learning_rate, ...), else from
TrainingArguments' documented default (learning_rate 5e-5, max_grad_norm 1.0, ...; the
scheduler's warmup_max_lr takes the optimizer's lr when the JSON gives one) with an info line
saying so. Batch sizes without args are inferred from the other batch keys as DeepSpeed
does (micro batch 8, TrainingArguments' default, when nothing else gives one). The ZeRO keys
use model.config.hidden_size (or max(hidden_sizes)) as HF does, else DeepSpeed's default. The
scheduler's total_num_steps needs args.max_steps; without it, it is an error naming the key.
Any other "auto" is an error: nothing here can fill it.
"""
from __future__ import annotations

import argparse
import copy
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from gigatron.training.config.deepspeed.batch import BATCH_KEYS

# TrainingArguments attribute and its default, for keys filled from one argument
_FROM_ARGS: Dict[str, Tuple[str, Any]] = {
    "gradient_clipping": ("max_grad_norm", 1.0),
    "optimizer.params.lr": ("learning_rate", 5e-5),
    "optimizer.params.eps": ("adam_epsilon", 1e-8),
    "optimizer.params.weight_decay": ("weight_decay", 0.0),
    "amp.opt_level": ("fp16_opt_level", "O1"),
}
_MICRO_DEFAULT = 8  # TrainingArguments.per_device_train_batch_size
# key -> (its value from the hidden size h, DeepSpeed's default)
_FROM_HIDDEN = {
    "zero_optimization.reduce_bucket_size": (lambda h: h * h, 500_000_000),
    "zero_optimization.stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), 50_000_000),
    "zero_optimization.stage3_param_persistence_threshold": (lambda h: 10 * h, 100_000),
}


def auto_paths(node: Any, path: str = "") -> List[str]:
    """The dotted keys whose value is "auto", in document order."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in auto_paths(v, f"{path}{k}." if isinstance(
            v, dict) else f"{path}{k}")]
    return [path] if node == "auto" else []


def _set(ds: Dict[str, Any], path: str, value: Any) -> None:
    *sections, leaf = path.split(".")
    node = ds
    for s in sections:
        node = node[s]
    if value is _DROP:
        del node[leaf]
    else:
        node[leaf] = value


_DROP = object()  # the key is removed: DeepSpeed's own inference or default applies


def _get(ds: Dict[str, Any], path: str) -> Any:
    """The value at a dotted key, or None."""
    node: Any = ds
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


class _Filler:
    """Fills one config's "auto" values; collects info lines and problems."""

    def __init__(self, ds: Dict[str, Any], dp: int, model: Optional[torch.nn.Module],
                 args: Optional[argparse.Namespace]) -> None:
        self.ds, self.dp, self.model, self.args = ds, dp, model, args
        self.info: List[str] = []
        self.problems: List[str] = []

    def arg(self, path: str, attr: str, default: Any) -> Any:
        value = getattr(self.args, attr, None)
        if value is not None:
            return value
        where = "args has no" if self.args is not None else "no args with"
        self.info.append(f'{path} "auto" -> {default!r} (Hugging Face TrainingArguments.{attr} '
                         f"default; {where} {attr})")
        return default

    def value(self, path: str) -> Any:
        """The value for one "auto" key (_DROP to let DeepSpeed's rule decide)."""
        if path in _FROM_ARGS:
            return self.arg(path, *_FROM_ARGS[path])
        if path in BATCH_KEYS:
            return self.batch(path)
        if path in _FROM_HIDDEN:
            return self.from_hidden(path)
        special = {"optimizer.params.betas": self.betas, "scheduler.params.warmup_min_lr":
                   lambda: 0, "scheduler.params.warmup_max_lr": self.warmup_max_lr,
                   "scheduler.params.total_num_steps": self.total_steps,
                   "scheduler.params.warmup_num_steps": self.warmup_steps,
                   "fp16.enabled": self.fp16, "amp.enabled": self.apex,
                   "bf16.enabled": self.bf16, "bfloat16.enabled": self.bf16}
        if path in special:
            return special[path]()
        self.problems.append(f'{path} is "auto", which only Hugging Face\'s Trainer fills for '
                             f"its own keys: give a value")
        return _DROP

    def betas(self) -> List[float]:
        return [self.arg("optimizer.params.betas[0]", "adam_beta1", 0.9),
                self.arg("optimizer.params.betas[1]", "adam_beta2", 0.999)]

    def half(self) -> bool:
        return bool(getattr(self.args, "fp16", False) or getattr(self.args, "fp16_full_eval",
                                                                 False))

    def warmup_max_lr(self) -> Any:
        """args.learning_rate as HF; without it the optimizer's own lr when the JSON gives one."""
        lr = _get(self.ds, "optimizer.params.lr")
        if getattr(self.args, "learning_rate", None) is None and isinstance(lr, (int, float)):
            self.info.append(f'scheduler.params.warmup_max_lr "auto" -> {lr!r} (the '
                             f"optimizer.params.lr; no args with learning_rate)")
            return lr
        return self.arg("scheduler.params.warmup_max_lr", "learning_rate", 5e-5)

    def fp16(self) -> bool:
        return self.half() and not self.apex()

    def apex(self) -> bool:
        return self.half() and getattr(self.args, "fp16_backend", None) == "apex"

    def bf16(self) -> bool:
        return bool(getattr(self.args, "bf16", False) or getattr(self.args, "bf16_full_eval",
                                                                 False))

    def batch(self, path: str) -> Any:
        micro = getattr(self.args, "per_device_train_batch_size", None)
        grad_acc = getattr(self.args, "gradient_accumulation_steps", None)
        if path == "train_micro_batch_size_per_gpu":
            return micro if micro is not None else _DROP
        if path == "gradient_accumulation_steps":
            return grad_acc if grad_acc is not None else _DROP
        return self.dp * micro * (grad_acc or 1) if micro is not None else _DROP

    def hidden_size(self) -> Optional[int]:
        config = getattr(self.model, "config", None)
        size = getattr(config, "hidden_size", None)
        if isinstance(size, int):
            return size
        sizes = getattr(config, "hidden_sizes", None)
        return max(sizes) if isinstance(sizes, (list, tuple)) and sizes else None

    def from_hidden(self, path: str) -> int:
        formula, default = _FROM_HIDDEN[path]
        size = self.hidden_size()
        if size is not None:
            return formula(size)
        self.info.append(f'{path} "auto" -> {default} (DeepSpeed\'s default: the model has no '
                         f"config.hidden_size to derive it from, as Hugging Face does)")
        return default

    def total_steps(self) -> Any:
        steps = getattr(self.args, "max_steps", None)
        if isinstance(steps, int) and steps > 0:
            return steps
        self.problems.append('scheduler.params.total_num_steps is "auto" (Hugging Face fills '
                             "it with the number of training steps): give the number, or pass "
                             "args with max_steps")
        return _DROP

    def warmup_steps(self) -> Any:
        steps = getattr(self.args, "warmup_steps", None) or 0
        ratio = steps if 0 < steps < 1 else getattr(self.args, "warmup_ratio", None) or 0
        if steps >= 1:
            return int(steps)
        if ratio <= 0:
            return self.arg("scheduler.params.warmup_num_steps", "warmup_steps", 0)
        total = _get(self.ds, "scheduler.params.total_num_steps")
        total = getattr(self.args, "max_steps", None) if total in (None, "auto") else total
        if isinstance(total, int) and total > 0:
            return math.ceil(total * ratio)
        self.problems.append('scheduler.params.warmup_num_steps is "auto" with a warm-up '
                             "ratio: give the number, or pass args with max_steps")
        return _DROP


def fill_auto(ds: Dict[str, Any], dp_world_size: int, model: Optional[torch.nn.Module] = None,
              args: Optional[argparse.Namespace] = None
              ) -> Tuple[Dict[str, Any], List[str], List[str]]:
    """(a copy of `ds` with every "auto" filled, info lines, problems). An "auto" batch key
    that args does not give, or any "auto" that cannot be filled, is removed from the copy (so
    DeepSpeed's rule or default applies, or the problem is reported once)."""
    out = copy.deepcopy(ds)
    filler = _Filler(out, dp_world_size, model, args)
    paths = auto_paths(out)
    for path in paths:
        _set(out, path, filler.value(path))
    batch_given = [k for k in BATCH_KEYS[:2] if isinstance(out.get(k), int)]
    if any(p in BATCH_KEYS for p in paths) and not batch_given:
        out["train_micro_batch_size_per_gpu"] = _MICRO_DEFAULT
        filler.info.append(f'train_micro_batch_size_per_gpu "auto" -> {_MICRO_DEFAULT} (Hugging '
                           f"Face TrainingArguments.per_device_train_batch_size default; no "
                           f"args with per_device_train_batch_size)")
    return out, filler.info, filler.problems
