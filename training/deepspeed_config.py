"""A DeepSpeed JSON config as pretrain_gpt.py flags (`--deepspeed-config PATH`).

`apply_deepspeed_config(ds, flags, explicit)` is pure: the JSON's values fill the flags not
given on the command line; a flag given with a different value is an error naming both (as
DeepSpeed refuses conflicting settings). Keys are read with DeepSpeed's documented meanings;
keys with no counterpart here are errors naming the key and what to use instead. Keys the
JSON leaves out keep pretrain_gpt.py's (Megatron's) defaults, e.g. --weight-decay 0.01.

    train_batch_size                     --global-batch-size
    train_micro_batch_size_per_gpu       --micro-batch-size
    gradient_accumulation_steps          checked: train = micro x grad_acc x dp (DeepSpeed's rule)
    gradient_clipping                    --clip-grad
    steps_per_print                      --log-interval
    wall_clock_breakdown                 --timing-log-level 1 (true) / 0 (false)
    fp16.enabled, bf16.enabled           --fp16, --bf16
    fp16.loss_scale                      --loss-scale (0 = dynamic = no --loss-scale)
    fp16.initial_scale_power             --initial-loss-scale 2**power
    fp16.loss_scale_window/hysteresis/min_loss_scale   the Megatron flags of the same name
    fp16.consecutive_hysteresis          ZeroConfig.consecutive_hysteresis (no Megatron flag)
    zero_optimization.stage              --zero-stage
    zero_optimization.reduce_bucket_size --ddp-bucket-size
    zero_optimization.overlap_comm       ZeroConfig.overlap_comm (no Megatron flag)
    zero_optimization.offload_optimizer  --optimizer-cpu-offload (device "cpu"; pin_memory true)
    optimizer.type Adam/AdamW/SGD        --optimizer adam (= AdamW) / sgd
    optimizer.params lr, betas, eps, weight_decay, momentum   --lr, --adam-beta1/2,
                                         --adam-eps, --weight-decay, --sgd-momentum

The fp16 loss-scaling keys apply only when fp16.enabled is true (DeepSpeed ignores them
otherwise); the zero_optimization/fp16 key lists are ZeroConfig's (`deepspeed_fields`).
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Dict, Mapping, Optional, Set, Tuple

from gigatron.parallel.zero.config import deepspeed_fields

# Namespace entries with no command-line flag: only a DeepSpeed config sets them.
CONFIG_ONLY_DESTS = {"overlap_comm": None, "consecutive_hysteresis": None,
                     "gradient_accumulation_steps": None}

_TOP_LEVEL = {"train_batch_size": "global_batch_size",
              "train_micro_batch_size_per_gpu": "micro_batch_size",
              "gradient_accumulation_steps": "gradient_accumulation_steps",
              "steps_per_print": "log_interval"}
_HANDLED = set(_TOP_LEVEL) | {"gradient_clipping", "wall_clock_breakdown", "fp16", "bf16",
                              "zero_optimization", "optimizer"}
_INSTEAD = {
    "scheduler": "use --lr-decay-style/--lr-warmup-iters/--lr-decay-iters/--min-lr",
    "activation_checkpointing": "use --recompute-granularity/--recompute-method/"
                                "--recompute-num-layers",
    "comms_logger": "collective bytes are counted in gigatron.parallel.comm.stats",
    "flops_profiler": "TFLOP/s and MFU are logged every --log-interval",
    "tensorboard": "use --tensorboard-dir", "csv_monitor": "use --metrics-file",
    "wandb": "use --metrics-file or --tensorboard-dir",
    "bfloat16": 'spell it "bf16"', "amp": 'use "fp16" or "bf16"',
    "pipeline": "use --pipeline-model-parallel-size",
    "checkpoint": "use --save/--load/--ckpt-format",
    "prescale_gradients": "gradients are averaged over data-parallel ranks after reduction",
    "gradient_predivide_factor": "gradients are averaged over data-parallel ranks after "
                                 "reduction",
    "data_types": "gradients accumulate in fp32; use --grad-reduce-in-bf16 to reduce in bf16",
}
# ZeroConfig field -> (flag dest, JSON value -> flag value)
_ZERO_DESTS: Dict[str, Tuple[str, Callable[[Any], Any]]] = {
    "zero_stage": ("zero_stage", int), "reduce_bucket_size": ("ddp_bucket_size", int),
    "overlap_comm": ("overlap_comm", bool),
    "offload_optimizer": ("optimizer_cpu_offload", lambda device: device == "cpu"),
    "clip_grad": ("clip_grad", float),
    "loss_scale": ("loss_scale", lambda scale: float(scale) if scale else None),
    "initial_scale_power": ("initial_loss_scale", lambda power: 2.0 ** power),
    "loss_scale_window": ("loss_scale_window", int), "hysteresis": ("hysteresis", int),
    "consecutive_hysteresis": ("consecutive_hysteresis", bool),
    "min_loss_scale": ("min_loss_scale", float),
}
_LOSS_SCALING = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "consecutive_hysteresis", "min_loss_scale")
_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam")
_SGD_PARAMS = ("lr", "momentum", "weight_decay")

# dest -> (JSON key, JSON value, flag value, same(explicit flag value, flag value) or None)
_Entry = Tuple[str, Any, Any, Optional[Callable[[Any, Any], bool]]]


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _reject_placeholders(node: Any, path: str = "") -> None:
    """HuggingFace's "auto" is filled by its Trainer; here there is nothing to fill it."""
    if isinstance(node, dict):
        for key, value in node.items():
            _reject_placeholders(value, f"{path}.{key}" if path else key)
    elif node == "auto":
        raise ValueError(f'{path} is "auto" (a HuggingFace Trainer placeholder): give the value '
                         f"or drop the key and use the pretrain_gpt.py flag")


def _check_keys(ds: Mapping) -> None:
    for key in ds:
        if key in _HANDLED:
            continue
        hint = _INSTEAD.get(key, f"supported keys: {', '.join(sorted(_HANDLED))}")
        raise ValueError(f"{key} is not supported: {hint}")


def _number(key: str, value: Any, integer: bool = False) -> Any:
    ok = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise ValueError(f"{key} must be {'an integer' if integer else 'a number'}, "
                         f"got {value!r}")
    return value


def _enabled(ds: Mapping, section: str) -> Optional[bool]:
    if section not in ds:
        return None
    body = ds[section]
    if not isinstance(body, dict):
        raise ValueError(f'{section} must be a JSON object like {{"enabled": true}}')
    if section == "bf16" and set(body) - {"enabled"}:
        raise ValueError(f"bf16.{sorted(set(body) - {'enabled'})[0]} is not supported; "
                         f"known keys: ['enabled']")
    enabled = body.get("enabled", False)
    if not isinstance(enabled, bool):
        raise ValueError(f"{section}.enabled must be true or false, got {enabled!r}")
    return enabled


def _batch_and_logging(ds: Mapping, out: Dict[str, _Entry]) -> None:
    for key, dest in _TOP_LEVEL.items():
        if key in ds:
            out[dest] = (key, ds[key], _number(key, ds[key], integer=True), None)
    if "wall_clock_breakdown" in ds:
        on = ds["wall_clock_breakdown"]
        if not isinstance(on, bool):
            raise ValueError(f"wall_clock_breakdown must be true or false, got {on!r}")
        # the phase timers are always logged; true synchronises the device around them
        out["timing_log_level"] = (
            "wall_clock_breakdown", on, int(on), lambda given, _: (given >= 1) == on)


def _precision(ds: Mapping, out: Dict[str, _Entry]) -> None:
    fp16, bf16 = _enabled(ds, "fp16"), _enabled(ds, "bf16")
    if fp16 is not None:
        out["fp16"] = ("fp16.enabled", fp16, fp16, None)
    if bf16 is not None:
        out["bf16"] = ("bf16.enabled", bf16, bf16, None)
    for field, (key, value) in deepspeed_fields(ds).items():
        if field in _LOSS_SCALING and not fp16:
            continue  # DeepSpeed reads loss scaling only with fp16 enabled
        _check_type(field, key, value)
        dest, convert = _ZERO_DESTS[field]
        out[dest] = (key, value, convert(value), None)


def _check_type(field: str, key: str, value: Any) -> None:
    """Types and ranges of the zero_optimization/fp16 values, named by their JSON key."""
    if field in ("overlap_comm", "consecutive_hysteresis"):
        if not isinstance(value, bool):
            raise ValueError(f"{key} must be true or false, got {value!r}")
    elif field == "offload_optimizer":
        if value not in ("cpu", "none"):
            raise ValueError(f'{key}.device {value!r} is not supported: use "cpu" or "none"')
    elif field == "zero_stage":
        if _number(key, value, integer=True) not in (0, 1, 2, 3):
            raise ValueError(f"{key} must be 0, 1, 2 or 3, got {value!r}")
    else:
        _number(key, value)


def _optimizer(ds: Mapping, out: Dict[str, _Entry]) -> None:
    if "optimizer" not in ds:
        return
    section = ds["optimizer"]
    if not isinstance(section, dict) or set(section) - {"type", "params"}:
        raise ValueError('optimizer must be {"type": "AdamW", "params": {...}}; got keys '
                         f"{sorted(section) if isinstance(section, dict) else section!r}")
    kind = str(section.get("type", "")).lower()
    params = section.get("params", {})
    if kind not in ("adam", "adamw", "sgd"):
        raise ValueError(f"optimizer.type {section.get('type')!r} is not supported: use Adam, "
                         f"AdamW or SGD")
    known = _SGD_PARAMS if kind == "sgd" else _ADAM_PARAMS
    for key in params:
        if key not in known:
            hint = "; use gradient_clipping" if key == "max_grad_norm" else ""
            raise ValueError(f"optimizer.params.{key} is not supported for "
                             f"{section['type']}; known: {', '.join(known)}{hint}")
    if kind == "adam" and params.get("adam_w_mode", True) is not True:
        raise ValueError("optimizer.params.adam_w_mode false (Adam with L2 weight decay) is not "
                         "supported: pretrain_gpt.py's adam is AdamW (decoupled weight decay)")
    # DeepSpeed's "Adam" runs in adam_w_mode by default, so Adam and AdamW are both AdamW
    flag = "sgd" if kind == "sgd" else "adam"
    out["optimizer"] = ("optimizer.type", section["type"], flag, None)
    simple = {"lr": "lr", "eps": "adam_eps", "weight_decay": "weight_decay",
              "momentum": "sgd_momentum"}
    for key, dest in simple.items():
        if key in params:
            value = float(_number(f"optimizer.params.{key}", params[key]))
            out[dest] = (f"optimizer.params.{key}", params[key], value, None)
    if "betas" in params:
        betas = params["betas"]
        if not (isinstance(betas, list) and len(betas) == 2):
            raise ValueError(f"optimizer.params.betas must be [beta1, beta2], got {betas!r}")
        for i, dest in enumerate(("adam_beta1", "adam_beta2")):
            value = float(_number("optimizer.params.betas", betas[i]))
            out[dest] = (f"optimizer.params.betas[{i}]", betas[i], value, None)


def apply_deepspeed_config(ds: Mapping, flags: argparse.Namespace,
                           explicit: Set[str]) -> argparse.Namespace:
    """The flags with the DeepSpeed config's values filled in; `explicit` holds the dests given
    on the command line, which must agree with the config. Raises a one-line ValueError."""
    if not isinstance(ds, dict):
        raise ValueError("a DeepSpeed config must be a JSON object")
    _reject_placeholders(ds)
    _check_keys(ds)
    entries: Dict[str, _Entry] = {}
    _batch_and_logging(ds, entries)
    _precision(ds, entries)
    _optimizer(ds, entries)
    if ("gradient_accumulation_steps" not in entries and "global_batch_size" in entries
            and "micro_batch_size" not in entries and flags.micro_batch_size is None):
        entries["gradient_accumulation_steps"] = (
            "train_batch_size", ds["train_batch_size"], 1, None)  # DeepSpeed: micro = train/dp
    out = argparse.Namespace(**vars(flags))
    for dest, (key, raw, value, same) in entries.items():
        given = getattr(flags, dest, None)
        if dest in explicit:
            agrees = same(given, value) if same else given == value
            if not agrees:
                shown = "" if isinstance(given, bool) else f" {given}"
                raise ValueError(
                    f"{_flag(dest)}{shown} on the command line conflicts with "
                    f"{key}: {json.dumps(raw)} in the DeepSpeed config: drop one or make "
                    f"them agree")
            continue
        setattr(out, dest, value)
    return out


def deepspeed_batch_sizes(train: Optional[int], micro: Optional[int], grad_acc: int,
                          dp: int) -> Tuple[int, int]:
    """(micro batch, global batch) by DeepSpeed's rule train = micro x grad_acc x dp."""
    if grad_acc < 1:
        raise ValueError(f"gradient_accumulation_steps must be >= 1, got {grad_acc}")
    if train is None and micro is None:
        raise ValueError("give train_batch_size or train_micro_batch_size_per_gpu in the "
                         "DeepSpeed config (or --micro-batch-size)")
    if micro is None:
        micro = max(train // (grad_acc * dp), 1)
    if train is None:
        train = micro * grad_acc * dp
    if train != micro * grad_acc * dp:
        raise ValueError(
            f"train_batch_size {train} != train_micro_batch_size_per_gpu {micro} x "
            f"gradient_accumulation_steps {grad_acc} x data-parallel size {dp} = "
            f"{micro * grad_acc * dp} (--global-batch-size = --micro-batch-size x "
            f"accumulation x dp): fix one of them")
    return micro, train


def load_deepspeed_config(path: str) -> Dict[str, Any]:
    """The JSON object in `path`, or a ValueError naming the flag and the problem."""
    try:
        with open(path) as f:
            ds = json.load(f)
    except OSError as err:
        raise ValueError(f"--deepspeed-config {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--deepspeed-config {path} is not valid JSON: {err}") from None
    if not isinstance(ds, dict):
        raise ValueError(f"--deepspeed-config {path} must hold a JSON object")
    return ds
