"""`"auto"` values of a DeepSpeed config, filled as Hugging Face's Trainer and accelerate fill them.

Where each value comes from (read at transformers 5.24.0, `integrations/deepspeed.py`
`HfTrainerDeepSpeedConfig.trainer_config_process`/`trainer_config_finalize`, and accelerate
1.15.0, `utils/dataclasses.py` `DeepSpeedPlugin` and `accelerator.py` `_prepare_deepspeed`):

- the Trainer's keys come from `args` when it has TrainingArguments' attribute
  (per_device_train_batch_size, learning_rate, max_grad_norm, ...), as the Trainer fills
  them; without it, from the environment variable `accelerate launch` sets where accelerate
  reads one (ACCELERATE_GRADIENT_CLIPPING, ACCELERATE_MIXED_PRECISION), else the documented
  default (learning_rate 5e-5, max_grad_norm 1.0, ...) with an info line saying so;
- accelerate's own keys (zero_optimization.stage, the offload devices and NVMe paths,
  stage3_gather_16bit_weights_on_model_save) come from its ACCELERATE_DEEPSPEED_* variables,
  else accelerate's defaults (stage 2, "none", false);
- batch sizes without args are inferred from the other batch keys as DeepSpeed does (micro
  batch 8, TrainingArguments' default, when nothing else gives one);
- the ZeRO bucket keys use the model's hidden size as both do (model.config.hidden_size,
  max(hidden_sizes), or the same of config.text_config), else DeepSpeed's default with an info
  line (both would refuse);
- the warm-up scheduler's steps: total_num_steps is args.max_steps (without it, an error
  naming the key); warmup_num_steps is max(1, args.warmup_steps, or a ratio of the total) as
  both give it (DeepSpeed >= 0.19.6 refuses 0); warmup_max_lr takes args.learning_rate, else
  the optimizer's lr as accelerate does.

Any other "auto" is an error: accelerate refuses it too (nothing fills it).
"""
from __future__ import annotations

import argparse
import copy
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from gigatron.training.config.deepspeed.batch import BATCH_KEYS

# key -> (TrainingArguments attribute, its default): what the Trainer fills from one argument
_FROM_ARGS: Dict[str, Tuple[str, Any]] = {
    "gradient_clipping": ("max_grad_norm", 1.0),
    "optimizer.params.lr": ("learning_rate", 5e-5),
    "optimizer.params.eps": ("adam_epsilon", 1e-8),
    "optimizer.params.weight_decay": ("weight_decay", 0.0),
    "amp.opt_level": ("fp16_opt_level", "O1"),  # transformers < 4.39
}


def _true(text: str) -> bool:
    return text.lower() == "true"


def _mixed_precision(*kinds: str) -> Callable[[str], bool]:
    return lambda text: text.lower() in kinds


# key -> (accelerate's environment variable, how accelerate parses it, accelerate's default)
_FROM_ACCELERATE: Dict[str, Tuple[str, Callable[[str], Any], Any]] = {
    "gradient_clipping": ("ACCELERATE_GRADIENT_CLIPPING", float, 1.0),
    "fp16.enabled": ("ACCELERATE_MIXED_PRECISION", _mixed_precision("fp16"), False),
    "bf16.enabled": ("ACCELERATE_MIXED_PRECISION", _mixed_precision("bf16", "fp8"), False),
    "zero_optimization.stage": ("ACCELERATE_DEEPSPEED_ZERO_STAGE", int, 2),
    "zero_optimization.offload_optimizer.device": (
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", str, "none"),
    "zero_optimization.offload_param.device": (
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", str, "none"),
    "zero_optimization.offload_optimizer.nvme_path": (
        "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH", str, "none"),
    "zero_optimization.offload_param.nvme_path": (
        "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH", str, "none"),
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": (
        "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", _true, False),
}
_MICRO_DEFAULT = 8  # TrainingArguments.per_device_train_batch_size
# key -> (its value from the hidden size h, DeepSpeed's default)
_FROM_HIDDEN = {
    "zero_optimization.reduce_bucket_size": (lambda h: h * h, 500_000_000),
    "zero_optimization.stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), 50_000_000),
    "zero_optimization.stage3_param_persistence_threshold": (lambda h: 10 * h, 100_000),
}
_DROP = object()  # the key is removed: DeepSpeed's own inference or default applies


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


def _get(ds: Dict[str, Any], path: str) -> Any:
    """The value at a dotted key, or None."""
    node: Any = ds
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def hidden_size(model: Optional[torch.nn.Module]) -> Optional[int]:
    """The model's hidden size as Hugging Face reads it for the ZeRO bucket keys."""
    config = getattr(model, "config", None)
    for where in (config, getattr(config, "text_config", None)):
        size = getattr(where, "hidden_size", None)
        if isinstance(size, int):
            return size
        sizes = getattr(where, "hidden_sizes", None)
        if isinstance(sizes, (list, tuple)) and sizes:
            return max(sizes)
    return None


class _Filler:
    """Fills one config's "auto" values; collects info lines and problems."""

    def __init__(self, ds: Dict[str, Any], dp: int, model: Optional[torch.nn.Module],
                 args: Optional[argparse.Namespace]) -> None:
        self.ds, self.dp, self.model, self.args = ds, dp, model, args
        self.info: List[str] = []
        self.problems: List[str] = []

    def pick(self, path: str, attr: Optional[str] = None, default: Any = None) -> Any:
        """args' TrainingArguments attribute (as the Trainer fills it), else accelerate's
        environment variable, else the default, with an info line saying which."""
        value = getattr(self.args, attr, None) if attr else None
        if value is not None:
            return value
        env, parse, accelerate_default = _FROM_ACCELERATE.get(path, ("", str, default))
        text = os.environ.get(env, "auto") if env else "auto"
        if text != "auto":  # accelerate reads "auto" as not given
            try:
                value = parse(text)
            except ValueError:
                self.problems.append(f'{path} is "auto" and {env}={text!r} does not say its '
                                     f"value: fix the variable or give the value")
                return _DROP
            self.info.append(f'{path} "auto" -> {value!r} (accelerate\'s {env}={text})')
            return value
        if attr is None:
            self.info.append(f'{path} "auto" -> {accelerate_default!r} (accelerate\'s default; '
                             f"{env} is not set)")
            return accelerate_default
        where = "args has no" if self.args is not None else "no args with"
        self.info.append(f'{path} "auto" -> {default!r} (Hugging Face TrainingArguments.{attr} '
                         f"default; {where} {attr})")
        return default

    def value(self, path: str) -> Any:
        """The value for one "auto" key (_DROP to let DeepSpeed's rule decide)."""
        if path in _FROM_ARGS:
            return self.pick(path, *_FROM_ARGS[path])
        if path in BATCH_KEYS:
            return self.batch(path)
        if path in _FROM_HIDDEN:
            return self.from_hidden(path)
        special = {"optimizer.params.betas": self.betas, "scheduler.params.warmup_min_lr":
                   lambda: 0, "scheduler.params.warmup_max_lr": self.warmup_max_lr,
                   "scheduler.params.total_num_steps": self.total_steps,
                   "scheduler.params.warmup_num_steps": self.warmup_steps,
                   "fp16.enabled": self.fp16, "amp.enabled": self.apex,
                   "bf16.enabled": lambda: self.precision("bf16"),
                   "bfloat16.enabled": lambda: self.precision("bf16")}
        if path in special:
            return special[path]()
        if path in _FROM_ACCELERATE:
            return self.pick(path)
        self.problems.append(f'{path} is "auto", which neither Hugging Face\'s Trainer nor '
                             f"accelerate fills: give a value")
        return _DROP

    def betas(self) -> List[float]:
        return [self.pick("optimizer.params.betas[0]", "adam_beta1", 0.9),
                self.pick("optimizer.params.betas[1]", "adam_beta2", 0.999)]

    def precision(self, kind: str) -> bool:
        """args.fp16 (bf16) or its *_full_eval as the Trainer reads them; without args,
        accelerate's mixed precision."""
        if hasattr(self.args, kind):
            return bool(getattr(self.args, kind) or getattr(self.args, f"{kind}_full_eval",
                                                            False))
        return bool(self.pick(f"{kind}.enabled"))

    def fp16(self) -> bool:
        return self.precision("fp16") and not self.apex()

    def apex(self) -> bool:
        """transformers < 4.39 sent fp16 through NVIDIA Apex with fp16_backend "apex"."""
        return getattr(self.args, "fp16_backend", None) == "apex" and bool(
            getattr(self.args, "fp16", False) or getattr(self.args, "fp16_full_eval", False))

    def warmup_max_lr(self) -> Any:
        """args.learning_rate as the Trainer; without it the optimizer's lr, as accelerate."""
        lr = _get(self.ds, "optimizer.params.lr")
        if getattr(self.args, "learning_rate", None) is None and isinstance(lr, (int, float)):
            self.info.append(f'scheduler.params.warmup_max_lr "auto" -> {lr!r} (the '
                             f"optimizer.params.lr; no args with learning_rate)")
            return lr
        return self.pick("scheduler.params.warmup_max_lr", "learning_rate", 5e-5)

    def batch(self, path: str) -> Any:
        micro = getattr(self.args, "per_device_train_batch_size", None)
        grad_acc = getattr(self.args, "gradient_accumulation_steps", None)
        if grad_acc is None and os.environ.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS",
                                               "").isdigit():
            grad_acc = int(os.environ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"])
        if path == "train_micro_batch_size_per_gpu":
            return micro if micro is not None else _DROP
        if path == "gradient_accumulation_steps":
            return grad_acc if grad_acc is not None else _DROP
        return self.dp * micro * (grad_acc or 1) if micro is not None else _DROP

    def from_hidden(self, path: str) -> int:
        formula, default = _FROM_HIDDEN[path]
        size = hidden_size(self.model)
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
        """max(1, the Trainer's get_warmup_steps): warmup_steps >= 1 is a count, below 1 a
        ratio of the total (older transformers: warmup_ratio)."""
        steps = getattr(self.args, "warmup_steps", None)
        if steps is not None and steps >= 1:
            return int(steps)
        ratio = steps if steps else getattr(self.args, "warmup_ratio", None) or 0
        if ratio <= 0:
            if steps is None:
                self.info.append('scheduler.params.warmup_num_steps "auto" -> 1 (no warm-up, '
                                 "Hugging Face TrainingArguments.warmup_steps default 0, "
                                 "raised to 1 as transformers and accelerate raise it; no "
                                 "args with warmup_steps)")
            return 1
        total = getattr(self.args, "max_steps", None)  # the Trainer's num_training_steps
        if not (isinstance(total, int) and total > 0):
            total = _get(self.ds, "scheduler.params.total_num_steps")
        if isinstance(total, int) and total > 0:
            return max(1, math.ceil(total * ratio))
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
