"""A DeepSpeed JSON config as pretrain_gpt.py flags, read through the config table.

Every row of the table (`training/config/table.py`) with a DeepSpeed key is read from the JSON with
DeepSpeed's meaning; the key list and the docs are in docs/FLAGS.md. `apply_deepspeed_config`
is pure: the JSON's values fill the flags not given on the command line; a flag given with a
different value is an error naming both (as DeepSpeed refuses conflicting settings). Unknown
keys are errors naming the key and what to use instead. Keys the JSON leaves out keep
pretrain_gpt.py's (Megatron's) defaults, e.g. --weight-decay 0.01. Loss-scaling keys apply
only with fp16.enabled true (DeepSpeed ignores them otherwise); "auto" is refused (no Trainer
fills it here: the flags say the values).

One reader with `gigatron.initialize`'s (`engine.py`'s `engine_config`): the same loader
(`source.py`), key walk (`keys.walk_keys`, over the table's keys here), batch rule
(`batch.py`), offload_optimizer reader (`offload.py`) and table rows (`read_rows`); only a key
the JSON leaves out differs: DeepSpeed's default there, the flag's default here.
"""
from __future__ import annotations

import argparse
import json
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from gigatron.training.config.deepspeed.keys import walk_keys
from gigatron.training.config.deepspeed.offload import offload_optimizer_device
from gigatron.training.config.deepspeed.source import load_config
from gigatron.training.config.spelling import did_you_mean
from gigatron.training.config.table import Row, deepspeed_default, flag_name, table
from gigatron.training.config.validation import ConfigError, dedupe

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
    "data_types": "gradients accumulate in the dtype they are reduced in: "
                  "--accumulate-allreduce-grads-in-fp32, --grad-reduce-in-bf16",
}
# top-level keys accepted at the value that says what gigatron does anyway (a real config
# often spells its defaults out): prescale false, predivide 1, accumulation in fp32
_AS_GIGATRON_DOES = {"prescale_gradients": False, "gradient_predivide_factor": 1.0,
                     "data_types": {"grad_accum_dtype": "fp32"}}
# accepted without a row: DeepSpeed's Adam switches (adam_w_mode must stay true)
_ADAM_ONLY_KEYS = ("adam_w_mode", "torch_adam")
_OPTIMIZER_TYPES = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}

# Under Megatron-DeepSpeed's --deepspeed switch its own loop drives these from the command line
# whatever the JSON says (megatron/training.py), so there the flag wins, with a banner note
MEGATRON_DEEPSPEED_FLAG_WINS = {
    "global_batch_size": "Megatron-DeepSpeed sets the engine's batch from --global-batch-size "
                         "every iteration (set_train_batch_size)",
    "log_interval": "steps_per_print paces only DeepSpeed's own prints; Megatron logs every "
                    "--log-interval",
}

# dest -> (JSON key, JSON value, flag value, same(explicit flag value, flag value) or None)
Entry = Tuple[str, Any, Any, Optional[Callable[[Any, Any], bool]]]


def _rows() -> List[Tuple[str, Row]]:
    """(DeepSpeed key, row) of every table row that has a DeepSpeed key."""
    return [(r.spec.ds, r) for r in table() if r.spec.ds]


def _path(key: str) -> List[str]:
    """'optimizer.params.betas[1]' -> ['optimizer', 'params', 'betas']."""
    return [re.sub(r"\[\d+\]$", "", part) for part in key.split(".")]


def _known_keys() -> Set[str]:
    """The dotted keys the table reads (zero_optimization.offload_optimizer whole)."""
    return {".".join(_path(key)) for key, _ in _rows()}


def _unknown(path: str, prefix: str, known: Set[str]) -> str:
    """A key pretrain_gpt.py does not read: the flag to use instead, or the known keys."""
    key = path[len(prefix):]
    if not prefix:
        hint = _INSTEAD.get(key, f"supported keys: {', '.join(sorted(known))}")
        return f"{key} is not supported: {hint}{did_you_mean(key, known)}"
    return f"{path} is not supported; known keys: {sorted(known)}{did_you_mean(key, known)}"


def _check_params(params: Any, ds_type: Any, problems: List[str]) -> None:
    """optimizer.params: the keys of its optimizer type (Adam's or SGD's rows)."""
    if not isinstance(params, dict):
        problems.append(f'optimizer.params must be a JSON object like {{"lr": 0.001}}, got '
                        f"{params!r}")
        return
    kind = _OPTIMIZER_TYPES.get(str(ds_type).lower())
    known = {_path(key)[-1] for key, _ in _rows() if key.startswith("optimizer.params.")
             and _params_kind(_path(key)[-1]) in (None, kind)}
    known |= set(_ADAM_ONLY_KEYS) if kind == "adam" else set()
    for key in params:
        if key not in known:
            hint = "; use gradient_clipping" if key == "max_grad_norm" else ""
            problems.append(f"optimizer.params.{key} is not supported for {ds_type}; known: "
                            f"{', '.join(sorted(known))}{hint}")


def _check_keys(ds: Mapping, problems: List[str]) -> None:
    """Every key of `ds` against the table's, by the engine reader's walk (`walk_keys`)."""
    def classify(path: str, value: Any) -> bool:
        if path in _AS_GIGATRON_DOES and value == _AS_GIGATRON_DOES[path]:
            return True
        if path == "optimizer.params":
            optimizer = ds.get("optimizer")
            _check_params(value, optimizer.get("type") if isinstance(optimizer, dict) else None,
                          problems)
            return True
        return False

    walk_keys(ds, _known_keys(), classify, _unknown, problems)


def _params_kind(param: str) -> Optional[str]:
    """'adam' or 'sgd' for optimizer.params keys of one optimizer type only."""
    kinds = {r.spec.ds_when for key, r in _rows() if _path(key)[-1] == param
             and key.startswith("optimizer.params.")}
    return next(iter(kinds)) if len(kinds) == 1 else None


def _reject_placeholders(node: Any, path: str, out: List[str]) -> None:
    """HuggingFace's "auto" is filled by its Trainer; here there is nothing to fill it."""
    if isinstance(node, dict):
        for key, value in node.items():
            _reject_placeholders(value, f"{path}.{key}" if path else key, out)
    elif node == "auto":
        out.append(f'{path} is "auto" (a HuggingFace Trainer placeholder): give the value '
                   f"or drop the key and use the pretrain_gpt.py flag")


def _lookup(ds: Mapping, key: str) -> Tuple[bool, Any]:
    """(present, value) of a dotted key; 'betas[1]' indexes a two-element list."""
    node: Any = ds
    for part in key.split("."):
        match = re.fullmatch(r"(\w+)\[(\d+)\]", part)
        name = match.group(1) if match else part
        if not isinstance(node, dict) or name not in node:
            return False, None
        node = node[name]
        if match:
            if not (isinstance(node, list) and len(node) == 2):
                raise ValueError(f"{key[:key.index('[')]} must be [beta1, beta2], got {node!r}")
            node = node[int(match.group(2))]
    return True, node


def _number(key: str, value: Any, integer: bool = False) -> Any:
    ok = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok):
        raise ValueError(f"{key} must be {'an integer' if integer else 'a number'}, "
                         f"got {value!r}")
    return value


def _boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def _count(key: str, value: Any) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # DeepSpeed configs often write 5e8
    return _number(key, value, integer=True)


def _offload(value: Any, info: List[str]) -> bool:
    """offload_optimizer -> --optimizer-cpu-offload, by the engine's reader (`offload.py`)."""
    problems: List[str] = []
    device = offload_optimizer_device(value, info, problems)
    if problems:
        raise ConfigError(problems)
    return device == "cpu"


def _optimizer_type(key: str, value: Any) -> str:
    # DeepSpeed's "Adam" runs in adam_w_mode by default, so Adam and AdamW are both AdamW
    kind = _OPTIMIZER_TYPES.get(str(value).lower())
    if kind is None:
        raise ValueError(f"{key} {value!r} is not supported: use Adam, AdamW or SGD")
    return kind


_CONVERT: Dict[str, Callable[[str, Any], Any]] = {
    "timing": lambda key, on: int(_boolean(key, on)),
    "loss_scale": lambda key, v: float(_number(key, v)) or None,  # 0 = dynamic
    "power_of_2": lambda key, power: 2.0 ** _number(key, power, integer=True),
    "count": _count, "optimizer_type": _optimizer_type,
}
_SAME: Dict[str, Callable[[Any, Any], bool]] = {
    "timing": lambda given, value: (given >= 1) == bool(value)}


def _convert(row: Row, key: str, raw: Any, info: List[str]) -> Any:
    """The flag value of a JSON value: by the row's ds_as, else by the row's type (info: lines
    for what is accepted without effect)."""
    value: Any
    if row.spec.ds_as == "offload":
        value = _offload(raw, info)
    elif row.spec.ds_as:
        value = _CONVERT[row.spec.ds_as](key, raw)
    elif row.type is bool:
        value = _boolean(key, raw)
    elif row.type is int:
        value = _number(key, raw, integer=True)
    elif row.type is float:
        value = float(_number(key, raw))
    else:
        value = raw
    choices = row.spec.choices
    if choices is not None and value not in choices:
        listed = ", ".join(map(str, choices[:-1])) + f" or {choices[-1]}"
        raise ValueError(f"{key} must be {listed}, got {raw!r}")
    return value


def _applies(row: Row, ds: Mapping) -> bool:
    """fp16 loss scaling needs fp16 on; Adam/SGD params need that optimizer type."""
    when = row.spec.ds_when
    if when == "fp16":
        return isinstance(ds.get("fp16"), dict) and ds["fp16"].get("enabled") is True
    if when in ("adam", "sgd"):
        optimizer = ds.get("optimizer")
        kind = optimizer.get("type") if isinstance(optimizer, dict) else None
        return _OPTIMIZER_TYPES.get(str(kind).lower()) == when
    return True


def read_deepspeed_config(ds: Mapping) -> Tuple[Dict[str, Entry], List[str], List[str]]:
    """(dest -> entry for every table key present in `ds`, every problem found, info lines
    for what is accepted without effect)."""
    if not isinstance(ds, dict):
        return {}, ["a DeepSpeed config must be a JSON object"], []
    problems: List[str] = []
    info: List[str] = []
    _reject_placeholders(ds, "", problems)
    _check_keys(ds, problems)
    optimizer = ds.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("params"), dict) and \
            optimizer["params"].get("adam_w_mode", True) is not True:
        problems.append("optimizer.params.adam_w_mode false (Adam with L2 weight decay) is not "
                        "supported: pretrain_gpt.py's adam is AdamW (decoupled weight decay)")
    entries: Dict[str, Entry] = {}
    for key, row in _rows():
        try:
            present, raw = _lookup(ds, key)
            if present and raw != "auto" and _applies(row, ds):
                entries[row.dest] = (key, raw, _convert(row, key, raw, info),
                                     _SAME.get(row.spec.ds_as or ""))
        except ConfigError as err:
            problems += err.problems
        except ValueError as err:
            problems.append(str(err))
    return entries, dedupe(problems), info


def read_rows(ds: Mapping, dests: Sequence[str],
              info: List[str]) -> Tuple[Dict[str, Any], List[str]]:
    """dest -> value of the named table rows as gigatron.initialize reads them: the JSON's value
    converted as for pretrain_gpt.py, or DeepSpeed's default (`deepspeed_default`) when the JSON
    leaves the key out (or fp16 is off, for loss-scaling keys); and every problem found (info
    lines go to `info`)."""
    rows = {r.dest: r for r in table()}
    values: Dict[str, Any] = {}
    problems: List[str] = []
    for dest in dests:
        row = rows[dest]
        values[dest] = deepspeed_default(row)
        try:
            present, raw = _lookup(ds, str(row.spec.ds))
            if present and _applies(row, ds):
                values[dest] = _convert(row, str(row.spec.ds), raw, info)
        except ConfigError as err:
            problems += err.problems
        except ValueError as err:
            problems.append(str(err))
    return values, problems


def apply_deepspeed_config(ds: Mapping, flags: argparse.Namespace,
                           explicit: Set[str]) -> argparse.Namespace:
    """The flags with the DeepSpeed config's values filled in; `explicit` holds the dests given
    on the command line, which must agree with the config (under Megatron-DeepSpeed's
    --deepspeed, the flags of MEGATRON_DEEPSPEED_FLAG_WINS win instead). Raises a ConfigError
    listing every problem (one line each)."""
    entries, problems, _ = read_deepspeed_config(ds)
    if ("gradient_accumulation_steps" not in entries and "global_batch_size" in entries
            and "micro_batch_size" not in entries and flags.micro_batch_size is None):
        entries["gradient_accumulation_steps"] = (
            "train_batch_size", ds["train_batch_size"], 1, None)  # DeepSpeed: micro = train/dp
    out = argparse.Namespace(**vars(flags))
    for dest, (key, raw, value, same) in entries.items():
        given = getattr(flags, dest, None)
        if dest not in explicit:
            setattr(out, dest, value)
        elif getattr(flags, "deepspeed", False) and dest in MEGATRON_DEEPSPEED_FLAG_WINS:
            continue  # the command line's value stays (deepspeed_config_notes says so)
        elif not (same(given, value) if same else given == value):
            shown = "" if isinstance(given, bool) else f" {given}"
            problems.append(f"{flag_name(dest)}{shown} on the command line conflicts with "
                            f"{key}: {json.dumps(raw)} in the DeepSpeed config: drop one or "
                            f"make them agree")
    _grad_accum_fp32(ds, out, problems)
    if problems:
        raise ConfigError(problems)
    return out


def _grad_accum_fp32(ds: Mapping, flags: argparse.Namespace, problems: List[str]) -> None:
    """data_types.grad_accum_dtype "fp32" (the one value accepted): gradients accumulate and
    are reduced in fp32, i.e. --accumulate-allreduce-grads-in-fp32 (Megatron's --bf16 default
    already; under --fp16 it must be set, else they would be fp16)."""
    section = ds.get("data_types")
    if not (isinstance(section, dict) and section.get("grad_accum_dtype") == "fp32"):
        return
    if flags.bf16 and flags.grad_reduce_in_bf16:
        problems.append('--grad-reduce-in-bf16 conflicts with data_types.grad_accum_dtype: '
                        '"fp32" in the DeepSpeed config: drop one')
    flags.accumulate_allreduce_grads_in_fp32 = True


def deepspeed_config_notes(flags: Mapping[str, Any]) -> List[str]:
    """Banner lines of --deepspeed-config: what it holds that is accepted without effect, and
    under --deepspeed the JSON values a Megatron-DeepSpeed command line overrode."""
    path = flags.get("deepspeed_config")
    if not path:
        return []
    entries, _, notes = read_deepspeed_config(load_deepspeed_config(path))
    notes = [f"--deepspeed-config: {line}" for line in notes]
    for dest, why in MEGATRON_DEEPSPEED_FLAG_WINS.items() if flags.get("deepspeed") else ():
        if dest in entries and flags.get(dest) != entries[dest][2]:
            key, raw = entries[dest][0], entries[dest][1]
            notes.append(f"{flag_name(dest)} {flags.get(dest)} is used, not {key}: "
                         f"{json.dumps(raw)} of the DeepSpeed config: {why}")
    return notes


def load_deepspeed_config(path: str) -> Dict[str, Any]:
    """The JSON object of --deepspeed-config (the one loader, errors naming the flag)."""
    return load_config(path, "--deepspeed-config")


def in_json_words(lines: Sequence[str], path: Optional[str]) -> List[str]:
    """Problem lines of a run that read --deepspeed-config, with each flag the JSON set named
    by the JSON key the user wrote ("train_micro_batch_size_per_gpu (--deepspeed-config)
    must be > 0"); the lines as they are without a config (or one that cannot be read)."""
    if not path or not lines:
        return list(lines)
    try:
        entries = read_deepspeed_config(load_deepspeed_config(path))[0]
    except ValueError:
        return list(lines)
    keys = {flag_name(dest): key for dest, (key, *_) in entries.items()
            if flag_name(dest).startswith("--")}
    if not keys:
        return list(lines)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, sorted(
        keys, key=len, reverse=True))) + r")(?![\w-])")
    return [pattern.sub(lambda m: f"{keys[m.group(1)]} (--deepspeed-config)", line)
            for line in lines]
