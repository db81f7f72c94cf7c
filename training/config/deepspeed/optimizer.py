"""The `"optimizer"` and `"scheduler"` sections of a DeepSpeed config, for `gigatron.initialize`.

Each optimizer type takes the params, with the defaults, of what DeepSpeed builds for it (read
at deepspeedai/DeepSpeed edaa7221, `_configure_basic_optimizer`): Adam and AdamW -> FusedAdam
(torch.optim.Adam/AdamW with `torch_adam`), Lamb -> FusedLamb, SGD -> torch.optim.SGD,
Adagrad -> torch.optim.Adagrad. So weight decay is 0 unless given, Adagrad's lr is 0.01 and its
eps 1e-10. "Adam" decouples weight decay (AdamW) unless `adam_w_mode` is false; "AdamW" always
does. With `torch_adam` DeepSpeed hands the params to torch, whose AdamW defaults weight_decay
to 0.01: so does this reader. Params OptimizerSpec has no field for (bias_correction, amsgrad,
...) go to OptimizerSpec.extra when they differ from DeepSpeed's default; what the optimizer
builder refuses (`optimizer_problems`, e.g. Adam's bias_correction false) is reported here.
Muon (DeepSpeed 0.19.8's MuonWithAuxAdam): the Muon half's lr is muon_lr, else lr, else 0.02;
the AdamW half's adam_lr, else lr, else 3e-4; momentum 0.95, ns_method "gram", betas
(0.9, 0.95), eps 1e-10, weight_decay 0 (both halves) -- its defaults, not Adam's.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

import torch

from gigatron.training.config.deepspeed.engine_config import SchedulerSpec
from gigatron.parallel.zero.optimizers import OptimizerSpec, optimizer_problems
from gigatron.training.config.spelling import did_you_mean

_ADAM = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
         "bias_correction": True, "amsgrad": False, "adam_w_mode": True, "torch_adam": False,
         "fp32_optimizer_states": True}
OPTIMIZER_PARAMS: Dict[str, Dict[str, Any]] = {  # lower-case type -> param -> default
    "adam": _ADAM, "adamw": _ADAM,
    "lamb": {"lr": 1e-3, "bias_correction": True, "betas": (0.9, 0.999), "eps": 1e-8,
             "eps_inside_sqrt": False, "weight_decay": 0.0, "max_coeff": 10.0,
             "min_coeff": 0.01, "amsgrad": False},
    "sgd": {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "weight_decay": 0.0,
            "nesterov": False, "maximize": False},
    "adagrad": {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0,
                "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": False},
    "muon": {"lr": None, "muon_lr": None, "adam_lr": None, "momentum": 0.95,
             "weight_decay": 0.0, "ns_method": "gram", "betas": (0.9, 0.95), "eps": 1e-10,
             "adam_w_mode": True, "torch_adam": False, "fp32_optimizer_states": True,
             "per_head_muon": False},
}
_MUON_LR, _ADAM_LR = 0.02, 3e-4  # MuonWithAuxAdam's group defaults when no lr is given
_SPELLED = {"adam": "Adam", "adamw": "AdamW", "lamb": "Lamb", "sgd": "SGD", "adagrad": "Adagrad",
            "muon": "Muon"}
# keyword arguments that only pick an implementation (torch's and FusedAdam's)
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "set_grad_none")
_PASS_OWN = "pass it as initialize(optimizer=...) and drop the optimizer section (under ZeRO " \
            "also set zero_allow_untested_optimizer true)"
DEEPSPEED_ONLY: Dict[str, str] = {  # DeepSpeed's own optimizer types -> what to use here
    "onebitadam": "1-bit Adam compresses the gradient all-reduce (it changes results): use "
                  "Adam, the same update without compression",
    "zerooneadam": "0/1 Adam compresses communication and skips variance updates: use Adam",
    "onebitlamb": "1-bit LAMB compresses the gradient all-reduce: use Lamb",
    "muadam": f"build mup.MuAdam(model.parameters(), ...) yourself and {_PASS_OWN}",
    "muadamw": f"build mup.MuAdamW(model.parameters(), ...) yourself and {_PASS_OWN}",
    "musgd": f"build mup.MuSGD(model.parameters(), ...) yourself and {_PASS_OWN}",
    "lion": f"build a Lion optimizer (e.g. from the lion-pytorch package) and {_PASS_OWN}",
}
SCHEDULER_TYPES = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


def _optimizer_type(raw: Any, problems: List[str]) -> Optional[str]:
    """The lower-case type, or None with the problem recorded."""
    listed = ", ".join(_SPELLED.values())
    if not isinstance(raw, str):
        problems.append(f"optimizer.type is required: one of {listed} (or drop the optimizer "
                        f"section and pass optimizer= to initialize)")
        return None
    kind = raw.lower()
    if kind in OPTIMIZER_PARAMS:
        return kind
    if kind in DEEPSPEED_ONLY:
        problems.append(f"optimizer.type {raw!r} (DeepSpeed's own) is not supported: "
                        f"{DEEPSPEED_ONLY[kind]}")
    elif isinstance(getattr(torch.optim, raw, None), type):
        problems.append(f"optimizer.type {raw!r}: DeepSpeed builds torch.optim.{raw} from it; "
                        f"here build torch.optim.{raw}(model.parameters(), ...) and {_PASS_OWN}")
    else:
        problems.append(f"optimizer.type {raw!r} is not supported: use one of {listed}"
                        f"{did_you_mean(raw, _SPELLED.values(), ignore_case=True)}")
    return None


def _number(key: str, value: Any, problems: List[str]) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        problems.append(f"{key} must be a number >= 0, got {value!r}")
        return None
    return float(value)


def _param(key: str, value: Any, default: Any, problems: List[str]) -> Any:
    """The checked value of one param (None when bad, with the problem recorded)."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        problems.append(f"{key} must be true or false, got {value!r}")
        return None
    if isinstance(default, str):  # ns_method: optimizer_problems checks the value
        if isinstance(value, str):
            return value
        problems.append(f"{key} must be a string, got {value!r}")
        return None
    if isinstance(default, tuple):  # betas
        if isinstance(value, (list, tuple)) and len(value) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1
                for b in value):
            return (float(value[0]), float(value[1]))
        problems.append(f"{key} must be [beta1, beta2] with each in [0, 1), got {value!r}")
        return None
    return _number(key, value, problems)


def _params(kind: str, params: Mapping, info: List[str], problems: List[str]) -> Dict[str, Any]:
    """Param -> value: DeepSpeed's defaults for `kind` overridden by the JSON's params."""
    defaults = OPTIMIZER_PARAMS[kind]
    values = dict(defaults)
    for name, raw in params.items():
        key = f"optimizer.params.{name}"
        if name == "max_grad_norm":
            problems.append(f"{key} is not supported (DeepSpeed refuses it too): use the "
                            f"top-level gradient_clipping")
        elif name in _IMPLEMENTATION:
            info.append(f"{key}: accepted, no effect here (it picks an implementation)")
        elif name not in defaults:
            problems.append(f"{key} is not a parameter of {_SPELLED[kind]}; known: "
                            f"{', '.join(sorted(defaults))}"
                            f"{did_you_mean(name, defaults, ignore_case=True)}")
        else:
            value = _param(key, raw, defaults[name], problems)
            if value is not None:
                values[name] = value
    if kind in ("adam", "adamw"):
        values["adam_w_mode"] = kind == "adamw" or values["adam_w_mode"]
        if values["torch_adam"] and values["adam_w_mode"] and "weight_decay" not in params:
            values["weight_decay"] = 0.01  # torch.optim.AdamW's default, as DeepSpeed gets it
    return values


def read_optimizer(section: Any, info: List[str], problems: List[str]) -> Optional[OptimizerSpec]:
    """The OptimizerSpec of an `"optimizer"` section; None when there is none (the caller
    passes an optimizer) or it is bad (problems recorded, one line each; a section that is not
    an object is `check_keys`'s to report)."""
    if not isinstance(section, dict):
        return None
    kind = _optimizer_type(section.get("type"), problems)
    params = section.get("params", {})
    if not isinstance(params, dict):
        problems.append(f'optimizer.params must be a JSON object like {{"lr": 0.001}}, got '
                        f'{params!r}')
        return None
    if kind is None:
        return None
    values = _params(kind, params, info, problems)
    if kind == "muon":
        return _muon_spec(values, problems)
    fields = {f.name for f in dataclasses.fields(OptimizerSpec)} - {"type", "extra"}
    defaults = OPTIMIZER_PARAMS[kind]
    spec = OptimizerSpec(type=kind, **{k: v for k, v in values.items() if k in fields},
                         extra={k: v for k, v in values.items()
                                if k not in fields and v != defaults[k]})
    refused = optimizer_problems(spec)  # what the ZeRO optimizer builder will not build
    problems += refused
    return None if refused else spec


def _muon_spec(values: Dict[str, Any], problems: List[str]) -> Optional[OptimizerSpec]:
    """Muon's spec: lr is the Muon half's, extra["adam_lr"] the AdamW half's."""
    if values["per_head_muon"]:
        problems.append("optimizer.params.per_head_muon is not built (Newton-Schulz per "
                        "attention head): remove it")
    lr = values["lr"]
    spec = OptimizerSpec(
        type="muon", lr=values["muon_lr"] if values["muon_lr"] is not None else
        lr if lr is not None else _MUON_LR, betas=values["betas"], eps=values["eps"],
        weight_decay=values["weight_decay"], momentum=values["momentum"],
        adam_w_mode=values["adam_w_mode"], torch_adam=values["torch_adam"],
        extra={"adam_lr": values["adam_lr"] if values["adam_lr"] is not None else
               lr if lr is not None else _ADAM_LR, "ns_method": values["ns_method"]})
    refused = optimizer_problems(spec)
    problems += refused
    return None if refused or values["per_head_muon"] else spec


def read_scheduler(section: Any, problems: List[str]) -> Optional[SchedulerSpec]:
    """The SchedulerSpec of a `"scheduler"` section (type checked, params carried); None
    when there is none or it is bad (problems recorded; a section that is not an object is
    `check_keys`'s to report)."""
    if not isinstance(section, dict):
        return None
    kind, params = section.get("type"), section.get("params", {})
    if not isinstance(params, dict):
        problems.append(f"scheduler.params must be a JSON object, got {params!r}")
    if kind not in SCHEDULER_TYPES:
        listed = ", ".join(SCHEDULER_TYPES)
        if isinstance(kind, str) and isinstance(getattr(torch.optim.lr_scheduler, kind, None),
                                                type):
            problems.append(f"scheduler.type {kind!r} is not one of DeepSpeed's schedulers "
                            f"({listed}): build torch.optim.lr_scheduler.{kind} yourself, pass "
                            f"it as initialize(lr_scheduler=...) and drop the scheduler section")
        else:
            problems.append(f"scheduler.type {kind!r} is not supported: use one of {listed}"
                            f"{did_you_mean(str(kind), SCHEDULER_TYPES, ignore_case=True)}")
        return None
    if not isinstance(params, dict):
        return None
    _check_scheduler_params(kind, params, problems)
    return SchedulerSpec(type=kind, params=dict(params))


def _check_scheduler_params(kind: str, params: Mapping, problems: List[str]) -> None:
    """Unknown and missing params, by the schedules' own signatures (when importable)."""
    try:
        from gigatron.training.lr.deepspeed import scheduler_params
    except ImportError:  # the schedules check their params when they are built
        return
    allowed = scheduler_params(kind)
    for name in params:
        if name not in allowed:
            problems.append(f"scheduler.params.{name} is not a parameter of {kind}; known: "
                            f"{', '.join(allowed)}{did_you_mean(name, allowed, ignore_case=True)}")
    for name, default in allowed.items():
        reported = any(line.startswith(f"scheduler.params.{name} ") for line in problems)
        if default == "REQUIRED" and name not in params and not reported:
            problems.append(f"scheduler.params.{name} is required by {kind}")
