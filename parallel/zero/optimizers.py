"""Optimizers as a DeepSpeed config names them, built over ZeRO's flat master shards.

`OptimizerSpec` is the contract between the config reader (training/config/deepspeed/optimizer.py,
which fills it with DeepSpeed's defaults per type) and ZeRO (which builds the torch optimizer over this
rank's master shards with `build_optimizer`). What DeepSpeed builds for each type, and here:
  adam     adam_w_mode=True (default): AdamW, decoupled decay; False: Adam with L2 decay
           (DeepSpeed's FusedAdam computes the same update as torch's classes)
  adamw    AdamW, whatever adam_w_mode says (as in DeepSpeed)
  sgd      torch.optim.SGD (momentum, dampening, nesterov, weight_decay as L2)
  adagrad  torch.optim.Adagrad (DeepSpeed hands its params to torch's class)
  lamb     gigatron.parallel.zero.lamb.Lamb: FusedLamb's update, trust ratio per parameter
           even when ZeRO shards the parameter
  muon     DeepSpeed's MuonWithAuxAdam: Muon on the parameters tagged use_muon, AdamW on the
           rest (ZeroOptimizer builds it: muon/build.py; extra holds ns_method)
A user's torch optimizer instance, or a callable building one from param groups, is adopted
instead by `make_optimizer` (DeepSpeed wraps a torch optimizer passed to initialize).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Sequence, Tuple, Union

import torch

from gigatron.parallel.zero.adam import UncorrectedAdam
from gigatron.parallel.zero.lamb import Lamb

if TYPE_CHECKING:
    from gigatron.parallel.zero.config import ZeroConfig

# DeepSpeed's optimizer "type" names (case-insensitive) this module builds
OPTIMIZER_TYPES = ("adam", "adamw", "sgd", "lamb", "adagrad", "muon")


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


# What `optimizer=` of build_zero accepts besides a spec: a torch optimizer to adopt, or a
# callable building one from param groups (DeepSpeed accepts both in initialize)
OptimizerFactory = Callable[[List[Dict[str, Any]]], torch.optim.Optimizer]
OptimizerArg = Union[OptimizerSpec, torch.optim.Optimizer, OptimizerFactory]

# Params DeepSpeed's fused Adam takes that torch's classes do not: the value torch behaves as
# (dropped when given, refused when different); None: any value (no effect on the update)
# (fp32_optimizer_states: under ZeRO the optimizer steps fp32 masters, so its state is fp32
# whatever the flag says -- in DeepSpeed's ZeRO as here)
# (bias_correction false builds UncorrectedAdam instead of torch's Adam/AdamW)
_FUSED_ADAM_ONLY: Dict[str, Any] = {"bias_correction": None, "set_grad_none": None,
                                    "fp32_optimizer_states": None}
_KERNEL_ONLY = {"adam": _FUSED_ADAM_ONLY, "adamw": _FUSED_ADAM_ONLY}


def spec_from_zero_config(config: "ZeroConfig") -> OptimizerSpec:
    """Megatron's optimizer flags as a spec: --optimizer adam means AdamW here (pretrain_gpt's
    ZeroConfig 'adamw'); ZeroConfig's 'adam' keeps torch.optim.Adam's L2 decay."""
    if config.optimizer == "sgd":
        return OptimizerSpec("sgd", lr=config.lr, momentum=config.sgd_momentum)
    return OptimizerSpec(config.optimizer, lr=config.lr,
                         betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
                         adam_w_mode=config.optimizer == "adamw")


def _unknown_type(type: object) -> str:
    return (f"optimizer type {type!r} is not supported: use one of "
            f"{', '.join(OPTIMIZER_TYPES)} (case-insensitive), or pass a torch optimizer")


def optimizer_problems(spec: OptimizerSpec) -> List[str]:
    """Every bad value of `spec`, one line each, naming DeepSpeed's key and the fix."""
    t = str(spec.type).lower()
    if t not in OPTIMIZER_TYPES:
        return [_unknown_type(spec.type)]
    betas = tuple(spec.betas)
    rules = [
        (spec.lr >= 0, f"optimizer.params.lr must be >= 0, got {spec.lr!r}"),
        (spec.eps >= 0, f"optimizer.params.eps must be >= 0, got {spec.eps!r}"),
        (spec.weight_decay >= 0,
         f"optimizer.params.weight_decay must be >= 0, got {spec.weight_decay!r}"),
        (len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas),
         f"optimizer.params.betas must be two numbers in [0, 1), got {spec.betas!r}"),
        (spec.momentum >= 0, f"optimizer.params.momentum must be >= 0, got {spec.momentum!r}"),
        (not spec.nesterov or (spec.momentum > 0 and spec.dampening == 0),
         f"optimizer.params.nesterov needs momentum > 0 and dampening 0, got momentum "
         f"{spec.momentum!r}, dampening {spec.dampening!r}"),
        (spec.lr_decay >= 0, f"optimizer.params.lr_decay must be >= 0, got {spec.lr_decay!r}"),
        (spec.initial_accumulator_value >= 0,
         f"optimizer.params.initial_accumulator_value must be >= 0, got "
         f"{spec.initial_accumulator_value!r}"),
        (0 < spec.min_coeff <= spec.max_coeff,
         f"optimizer.params needs 0 < min_coeff <= max_coeff, got {spec.min_coeff!r}, "
         f"{spec.max_coeff!r}"),
    ]
    if t == "muon":
        rules += [(spec.momentum < 1, f"optimizer.params.momentum must be in [0, 1), got "
                                      f"{spec.momentum!r}"),
                  (spec.extra.get("ns_method", "gram") in ("gram", "standard"),
                   f"optimizer.params.ns_method must be \"gram\" or \"standard\", got "
                   f"{spec.extra.get('ns_method')!r}")]
    for key, torch_value in _KERNEL_ONLY.get(t, {}).items():
        value = spec.extra.get(key, torch_value)
        rules.append((torch_value is None or value == torch_value,
                      f"optimizer.params.{key}={value!r} is not supported for {t} (torch's "
                      f"update always behaves as {key}={torch_value!r}): remove it"))
    return [message for ok, message in rules if not ok]


def build_optimizer(spec: OptimizerSpec, param_groups: Sequence[Dict[str, Any]]
                    ) -> torch.optim.Optimizer:
    """The torch optimizer `spec` names, over `param_groups` (torch's format; a group's own
    options override the spec's)."""
    problems = optimizer_problems(spec)
    if spec.type == "muon":
        problems.append("optimizer type 'muon' is built by ZeroOptimizer over its flat groups "
                        "(its matrices apart), not over param groups alone")
    if problems:
        raise ValueError("\n".join(problems))
    cls, kwargs = _constructor(spec)
    if cls in (torch.optim.Adam, torch.optim.AdamW) and _fusable(param_groups) and \
            "foreach" not in kwargs and "fused" not in kwargs:
        kwargs["fused"] = True  # see _fusable
    try:
        return cls([dict(g) for g in param_groups], **kwargs)
    except TypeError as err:  # an `extra` param the class does not take
        raise ValueError(f"optimizer type {spec.type!r} ({cls.__name__}) refused its params "
                         f"{sorted(spec.extra)}: {err}; remove the params it names") from err


def _fusable(param_groups: Sequence[Dict[str, Any]]) -> bool:
    """Every parameter a floating-point tensor on the CPU (--optimizer-cpu-offload's master
    shards) or every one on a GPU: Adam then runs torch's fused kernel, one pass over param,
    grad and both moments. torch's defaults are slower: on the CPU the single-tensor path's
    separate elementwise passes (about 8x the step time on 1e7-element shards:
    bench/bench_cpu_adam.py), on a GPU the foreach path's ~6 multi-tensor passes (28 ms of a
    324 ms GPT 1.3B step on an H200, against ~9 ms for one pass over the 1.3e9 x 28 bytes).
    The update is the same to rounding (tests/test_cpu_adam.py); a spec's own foreach/fused
    is kept."""
    params: List[Any] = []
    for group in param_groups:
        ps = group.get("params", [])
        params += [ps] if isinstance(ps, torch.Tensor) else list(ps)
    kinds = {p.device.type if isinstance(p, torch.Tensor) and p.is_floating_point() else None
             for p in params}
    return len(kinds) == 1 and kinds <= {"cpu", "cuda"}


def _constructor(spec: OptimizerSpec) -> Tuple[type, Dict[str, Any]]:
    t = spec.type.lower()
    extra = {k: v for k, v in spec.extra.items() if k not in _KERNEL_ONLY.get(t, {})}
    common = dict(lr=spec.lr, eps=spec.eps, weight_decay=spec.weight_decay)
    if t in ("adam", "adamw"):
        decoupled = t == "adamw" or spec.adam_w_mode  # DeepSpeed: "AdamW" is always decoupled
        cls: type = torch.optim.AdamW if decoupled else torch.optim.Adam
        kwargs = dict(common, betas=tuple(spec.betas))
        if spec.extra.get("bias_correction", True) is False:
            cls, kwargs = UncorrectedAdam, dict(kwargs, decoupled=decoupled)
    elif t == "sgd":
        cls, kwargs = torch.optim.SGD, dict(lr=spec.lr, momentum=spec.momentum,
                                            dampening=spec.dampening, nesterov=spec.nesterov,
                                            weight_decay=spec.weight_decay)
    elif t == "adagrad":
        cls, kwargs = torch.optim.Adagrad, dict(
            common, lr_decay=spec.lr_decay,
            initial_accumulator_value=spec.initial_accumulator_value)
    else:
        cls, kwargs = Lamb, dict(common, betas=tuple(spec.betas), max_coeff=spec.max_coeff,
                                 min_coeff=spec.min_coeff)
    return cls, {**kwargs, **extra}


def make_optimizer(optimizer: OptimizerArg, param_groups: List[Dict[str, Any]]
                   ) -> torch.optim.Optimizer:
    """The torch optimizer over `param_groups` (ZeRO's master shards, one group per user
    group, the user's options): built from a spec or a factory, or the user's own adopted."""
    if isinstance(optimizer, OptimizerSpec):
        return build_optimizer(optimizer, param_groups)
    if isinstance(optimizer, torch.optim.Optimizer):
        return adopt_optimizer(optimizer, [g["params"] for g in param_groups])
    if callable(optimizer):
        built = optimizer(param_groups)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a "
                            f"torch.optim.Optimizer")
        got = [id(p) for g in built.param_groups for p in g["params"]]
        if sorted(got) != sorted(id(p) for g in param_groups for p in g["params"]):
            raise ValueError("the optimizer callable must optimize exactly the param groups "
                             "it is given (ZeRO's flat master shards), not other tensors")
        return built
    raise TypeError(f"optimizer must be an OptimizerSpec, a torch.optim.Optimizer or a "
                    f"callable(param_groups) -> Optimizer, got {type(optimizer).__name__}")


def adopt_optimizer(optimizer: torch.optim.Optimizer,
                    params_per_group: Sequence[List[torch.Tensor]]) -> torch.optim.Optimizer:
    """Re-point the SAME optimizer's param groups (in place, options kept, so an lr scheduler
    built on it keeps working) at ZeRO's master shards, and drop its state."""
    if len(params_per_group) != len(optimizer.param_groups):
        raise ValueError(f"{len(params_per_group)} groups of master shards for an optimizer "
                         f"with {len(optimizer.param_groups)} param groups")
    for group, params in zip(optimizer.param_groups, params_per_group):
        group["params"] = list(params)
    optimizer.state.clear()
    if isinstance(optimizer, torch.optim.Adagrad):
        # Adagrad creates its accumulators in its constructor (from the constructor's
        # initial_accumulator_value), not lazily in step(): let a twin create them
        twin = torch.optim.Adagrad([dict(g) for g in optimizer.param_groups],
                                   initial_accumulator_value=optimizer.defaults.get(
                                       "initial_accumulator_value", 0.0))
        optimizer.state.update(twin.state)
    return optimizer
