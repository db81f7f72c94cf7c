"""`engine_config`: a DeepSpeed config read for `gigatron.initialize`, with DeepSpeed's meanings
and DeepSpeed's defaults.

One pass, every problem collected and raised at once (a ConfigError, one line each): the
source (a dict, a JSON file, or DeepSpeed's base64 string; a bad file or bad JSON is one line
naming the file and the position: `source.py`), "auto" values (`auto.py`), DeepSpeed's legacy
spellings and every key (`keys.py`: unknown keys with the nearest spelling, info lines for
speed-only keys), the config table's rows through `read_rows` (batch sizes, fp16/bf16 and loss
scaling, ZeRO stage/bucket/overlap, gradient_clipping, steps_per_print,
wall_clock_breakdown), the batch triple (`batch.py`), offload_optimizer (`offload.py`), the
optimizer and scheduler (`optimizer.py`) and the keys only the engine reads. pretrain_gpt.py's
--deepspeed-config (`pretrain.py`) shares all of these but "auto" and the engine-only keys.

Keys the JSON leaves out get DeepSpeed's defaults, not pretrain_gpt.py's (Megatron's); where
they differ docs/FLAGS.md shows both: no gradient clipping (0), no weight decay (0), SGD
momentum 0, steps_per_print 10, overlap_comm only at stage 3. These are DeepSpeed's defaults up
to 0.19.2 and as issue 15 specifies; DeepSpeed 0.19.3 (#8068) clips at 1.0 by default and
0.15.2 made steps_per_print default to no printing.
Gradients are accumulated and reduced in communication_data_type, by default the training
dtype (fp16, bf16 or fp32), as DeepSpeed's engine (its communication_data_type property; its
data_types.grad_accum_dtype defaults to the training dtype too).
Deliberate differences from DeepSpeed: a communication_data_type other than the training
dtype is also the dtype gradients accumulate in (DeepSpeed accumulates in the training dtype
and casts for the wire); unknown keys are errors (DeepSpeed ignores unknown top-level keys);
offload_optimizer "nvme" offloads to host memory.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from gigatron.training.config.deepspeed.engine_config import EngineConfig
from gigatron.parallel.zero.config import ZeroConfig, zero_problems
from gigatron.parallel.zero.optimizers import OptimizerSpec
from gigatron.training.config.table import row_of
from gigatron.training.config.deepspeed.auto import fill_auto
from gigatron.training.config.deepspeed.batch import BATCH_KEYS, deepspeed_batch_triple
from gigatron.training.config.deepspeed.pretrain import read_rows
from gigatron.training.config.deepspeed.keys import ENGINE_KEYS, check_keys, normalize_legacy
from gigatron.training.config.deepspeed.offload import offload_optimizer_device
from gigatron.training.config.deepspeed.optimizer import read_optimizer, read_scheduler
from gigatron.training.config.deepspeed.source import ConfigSource, load_config
from gigatron.training.config.validation import ConfigError, Problems

# the config table rows the engine reads (argparse dests), batch sizes first
_BATCH_ROWS = ("global_batch_size", "micro_batch_size", "gradient_accumulation_steps")
_ROWS = ("fp16", "bf16", "loss_scale", "initial_loss_scale", "min_loss_scale",
         "loss_scale_window", "hysteresis", "consecutive_hysteresis", "zero_stage",
         "ddp_bucket_size", "overlap_comm", "clip_grad", "log_interval", "timing_log_level")
# ZeroConfig field -> the JSON key a problem names
_ZERO_KEYS = {**{f: str(row_of(d).spec.ds) for f, d in (
    ("zero_stage", "zero_stage"), ("reduce_bucket_size", "ddp_bucket_size"),
    ("clip_grad", "clip_grad"), ("loss_scale", "loss_scale"),
    ("loss_scale_window", "loss_scale_window"), ("hysteresis", "hysteresis"),
    ("min_loss_scale", "min_loss_scale"))},
    "offload_optimizer": "zero_optimization.offload_optimizer.device",
    "grad_reduce_dtype": "communication_data_type"}
_TAG_VALIDATION = ("Ignore", "Warn", "Fail")


def _value(ds: Mapping, key: str, p: Problems) -> Any:
    """The JSON's value of an ENGINE_KEYS key, type-checked against its default, or the default
    (also when the value is bad, with the problem recorded)."""
    default = ENGINE_KEYS[key]
    node: Any = ds
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    if isinstance(default, bool):
        ok, kind = isinstance(node, bool), "true or false"
    elif isinstance(default, (int, float)):
        ok, kind = isinstance(node, (int, float)) and not isinstance(node, bool), "a number"
    elif isinstance(default, str):
        ok, kind = isinstance(node, str), "a string"
    else:
        ok, kind = True, ""
    if not ok:
        p.add(f"{key} must be {kind}, got {json.dumps(node)}")
        return default
    return node


def _precision(ds: Mapping, values: Dict[str, Any], p: Problems) -> Tuple[str, bool]:
    """('fp16' | 'bf16' | 'fp32', fp16.auto_cast in effect)."""
    if values["fp16"] and values["bf16"]:
        p.add("fp16.enabled and bf16.enabled are both true: enable one (DeepSpeed refuses "
              "both too)")
    auto_cast = _value(ds, "fp16.auto_cast", p)
    precision = "fp16" if values["fp16"] else "bf16" if values["bf16"] else "fp32"
    return precision, bool(values["fp16"] and auto_cast)


def _offload(ds: Mapping, info: List[str], p: Problems) -> str:
    """offload_optimizer (`offload.py`) as ZeroConfig.offload_optimizer; offload_param: an
    info line."""
    param = _value(ds, "zero_optimization.offload_param.device", p)
    if param in ("cpu", "nvme"):
        info.append(f"zero_optimization.offload_param.device {param}: accepted, parameters "
                    f"stay on the accelerator (ZeRO-3 shards them; offloading them is not "
                    f"implemented)")
    elif param != "none":
        p.add(f'zero_optimization.offload_param.device must be "cpu", "nvme" or "none", got '
              f"{param!r}")
    zero = ds.get("zero_optimization")
    section = zero.get("offload_optimizer", {}) if isinstance(zero, dict) else {}
    return offload_optimizer_device(section, info, p.lines)


def _reduce_dtype(ds: Mapping, values: Dict[str, Any], p: Problems) -> str:
    """The dtype gradients accumulate and travel in: communication_data_type, else
    data_types.grad_accum_dtype, else the training dtype (DeepSpeed's default of both)."""
    dtype = ds.get("communication_data_type")
    accumulate = _value(ds, "data_types.grad_accum_dtype", p)
    if accumulate not in (None, "fp32", "fp16", "bf16"):
        p.add(f'data_types.grad_accum_dtype must be "fp32", "fp16" or "bf16", got '
              f"{accumulate!r}")
    elif dtype is not None and accumulate is not None and str(dtype).lower() != accumulate:
        p.add(f"data_types.grad_accum_dtype {accumulate!r} and communication_data_type "
              f"{dtype!r} differ: gradients accumulate in the dtype they are reduced in here; "
              f"give one of them")
    if dtype is None:
        return accumulate or ("fp16" if values["fp16"] else "bf16" if values["bf16"] else "fp32")
    if isinstance(dtype, str) and dtype.lower() in ("fp32", "fp16", "bf16"):
        return dtype.lower()
    p.add(f'communication_data_type must be "fp32", "fp16" or "bf16", got {dtype!r}')
    return "fp32"


def _optimizer_fields(spec: Optional[OptimizerSpec]) -> Dict[str, Any]:
    """ZeroConfig's optimizer numbers mirrored from the spec (the engine builds from the
    spec; without one, DeepSpeed's no weight decay)."""
    if spec is None:
        return {"weight_decay": 0.0}
    return {"lr": spec.lr, "weight_decay": spec.weight_decay, "adam_beta1": spec.betas[0],
            "adam_beta2": spec.betas[1], "adam_eps": spec.eps, "sgd_momentum": spec.momentum}


def _zero(ds: Mapping, values: Dict[str, Any], optimizer: Optional[OptimizerSpec],
          info: List[str], p: Problems) -> Optional[ZeroConfig]:
    """The ZeroConfig (stage, buckets, clipping, loss scaling, offload, reduce dtype)."""
    stage, overlap, bucket = values["zero_stage"], values["overlap_comm"], values["ddp_bucket_size"]
    if bucket == 0:  # DeepSpeed allows 0: every gradient is reduced on its own
        info.append("zero_optimization.reduce_bucket_size 0: each gradient is reduced on its "
                    "own (buckets of 1 element)")
        bucket = 1
    kw = dict(zero_stage=stage, reduce_bucket_size=bucket,
              overlap_comm=stage == 3 if overlap is None else overlap,
              stage3_prefetch=_value(ds, "zero_optimization.stage3_prefetch_bucket_size", p) > 0,
              clip_grad=values["clip_grad"], loss_scale=values["loss_scale"] or 0.0,
              initial_scale_power=int(round(math.log2(values["initial_loss_scale"]))),
              loss_scale_window=values["loss_scale_window"], hysteresis=values["hysteresis"],
              consecutive_hysteresis=bool(values["consecutive_hysteresis"]),
              loss_scale_rule="deepspeed",
              min_loss_scale=values["min_loss_scale"], offload_optimizer=_offload(ds, info, p),
              grad_reduce_dtype=_reduce_dtype(ds, values, p), **_optimizer_fields(optimizer))
    problems = zero_problems(kw, _ZERO_KEYS)
    p.lines += problems
    return None if problems else ZeroConfig(**kw)


def _section(ds: Mapping, name: str, p: Problems) -> Dict[str, Any]:
    """A section's ENGINE_KEYS with DeepSpeed's defaults filled in."""
    return {k.split(".", 1)[1]: _value(ds, k, p) for k in ENGINE_KEYS
            if k.startswith(name + ".")}


def _checkpoint(ds: Mapping, info: List[str], p: Problems) -> Dict[str, Any]:
    section = _section(ds, "checkpoint", p)
    mode = str(section["tag_validation"]).capitalize()
    if mode not in _TAG_VALIDATION:
        p.add(f"checkpoint.tag_validation must be one of {', '.join(_TAG_VALIDATION)}, got "
              f"{section['tag_validation']!r}")
    section["tag_validation"] = mode
    if section["load_universal"]:
        info.append("checkpoint.load_universal: accepted; gigatron's checkpoints load under any "
                    "layout anyway")
    return section


def _monitors(ds: Mapping, p: Problems) -> Dict[str, Any]:
    """tensorboard / csv_monitor folders (output_path/job_name, as DeepSpeed) and wandb."""
    out: Dict[str, Any] = {}
    for name, field in (("tensorboard", "tensorboard_dir"), ("csv_monitor", "csv_dir")):
        section = _section(ds, name, p)
        if section["enabled"]:
            out[field] = os.path.join(section["output_path"], section["job_name"])
    wandb = _section(ds, "wandb", p)
    if wandb["enabled"]:
        try:
            importlib.import_module("wandb")
        except Exception as err:  # an ImportError, or a broken install
            p.add(f"wandb.enabled is true but `import wandb` fails ({type(err).__name__}: "
                  f"{err}): pip install wandb, or log with tensorboard or csv_monitor")
        out.update(wandb_project=wandb["project"], wandb_group=wandb["group"],
                   wandb_team=wandb["team"])
    return out


def _engine_fields(ds: Mapping, info: List[str], p: Problems) -> Dict[str, Any]:
    """The EngineConfig fields only the engine reads."""
    predivide = _value(ds, "gradient_predivide_factor", p)
    if predivide <= 0:
        p.add(f"gradient_predivide_factor must be > 0, got {predivide}")
    return dict(prescale_gradients=_value(ds, "prescale_gradients", p),
                gradient_predivide_factor=float(predivide),
                zero_allow_untested_optimizer=_value(ds, "zero_allow_untested_optimizer", p),
                dataloader_drop_last=_value(ds, "dataloader_drop_last", p),
                auto_cast_inputs=_value(ds, "auto_cast_inputs", p),
                activation_checkpointing=_section(ds, "activation_checkpointing", p),
                checkpoint=_checkpoint(ds, info, p), **_monitors(ds, p))


def _batch(ds: Mapping, dp: int, p: Problems) -> Optional[Tuple[int, int, int]]:
    values, problems = read_rows(ds, _BATCH_ROWS, [])  # batch rows give no info lines
    if problems:
        p.lines += problems
        return None
    return p.run(deepspeed_batch_triple, values["global_batch_size"],
                 values["micro_batch_size"], values["gradient_accumulation_steps"], dp)


def engine_config(config: ConfigSource, world_size: int, *, dp_world_size: Optional[int] = None,
                  model: Optional[torch.nn.Module] = None,
                  args: Optional[argparse.Namespace] = None) -> EngineConfig:
    """A DeepSpeed config (path, dict or base64 text) for `gigatron.initialize`, resolved with
    DeepSpeed's meanings and defaults: batch triple complete, "auto" filled from the model,
    `args` and the data-parallel size (default `world_size`). Every problem raises together,
    as one ConfigError (a ValueError) with one line each (prefixed with the file's path)."""
    raw = load_config(config)
    dp = world_size if dp_world_size is None else dp_world_size
    if dp < 1 or world_size < 1:
        raise ValueError(f"world_size {world_size} and dp_world_size {dp} must be >= 1")
    try:
        return _read(raw, dp, model, args)
    except ConfigError as err:
        if isinstance(config, Mapping):
            raise
        raise ConfigError([f"DeepSpeed config {os.fspath(config)}: {line}"
                           for line in err.problems]) from None


def _read(raw: Dict[str, Any], dp: int, model: Optional[torch.nn.Module],
          args: Optional[argparse.Namespace]) -> EngineConfig:
    p = Problems()
    filled, info, p.lines = fill_auto(raw, dp, model, args)
    ds, legacy = normalize_legacy(filled)
    p.lines += legacy
    check_keys(ds, info, p.lines)
    values, problems = read_rows(ds, _ROWS, info)
    p.lines += problems
    if values["log_interval"] < 1:
        p.add(f"steps_per_print must be >= 1, got {values['log_interval']}")
    batch = _batch(ds, dp, p)
    precision, auto_cast = _precision(ds, values, p)
    optimizer = read_optimizer(ds.get("optimizer"), info, p.lines)
    scheduler = read_scheduler(ds.get("scheduler"), p.lines)
    zero = _zero(ds, values, optimizer, info, p)
    fields = _engine_fields(ds, info, p)
    p.raise_if_any()
    assert batch is not None and zero is not None  # raise_if_any: both were built
    resolved = copy.deepcopy(filled)
    resolved.update({k: v for k, v in zip(BATCH_KEYS, batch) if raw.get(k) == "auto"})
    return EngineConfig(*batch, zero=zero, precision=precision, fp16_auto_cast=auto_cast,
                        optimizer=optimizer, scheduler=scheduler,
                        steps_per_print=values["log_interval"],
                        wall_clock_breakdown=bool(values["timing_log_level"]), info=info,
                        resolved=resolved, **fields)
