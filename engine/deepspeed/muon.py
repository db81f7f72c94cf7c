"""DeepSpeed's `"optimizer": {"type": "Muon"}`: which parameters are Muon's, and its groups.

As deepspeed.initialize (0.19.8: `set_optimizer_flags`, `DeepSpeedEngine._muon_param_groups`):
every parameter of the model is tagged `use_muon` -- True for a tensor of 2 or more dimensions
whose name holds neither "embed" nor "lm_head" (case-insensitive), else False; a tag the user
set before is overwritten, as DeepSpeed does. Each param group given (loose parameters form
one) is split into its Muon half and its AdamW half, each a group of its own, Muon's first:
the half takes the config's values (lr from muon_lr / adam_lr), then the group's own keys that
the half understands (Muon: lr, momentum, weight_decay, ns_method; AdamW: lr, betas, eps,
weight_decay); named "muon-params"/"adam-params" (prefixed by the group's name, or "groupN"
when several groups are given). Frozen parameters are left out, empty halves dropped.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional

from torch import nn

from gigatron.parallel.zero.optimizers import OptimizerSpec

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")


def tag_use_muon(module: nn.Module) -> None:
    """Set `use_muon` on every parameter of `module` by DeepSpeed's rule."""
    for name, p in module.named_parameters():
        lowered = name.lower()
        setattr(p, "use_muon", p.dim() >= 2 and "embed" not in lowered and "lm_head" not in lowered)


def muon_param_groups(model_parameters: Optional[Iterable[Any]], module: nn.Module,
                      spec: OptimizerSpec) -> List[Dict[str, Any]]:
    """The param groups DeepSpeed hands MuonWithAuxAdam (Muon's half, then AdamW's, per
    group given)."""
    items = list(module.parameters() if model_parameters is None else model_parameters)
    groups = [dict(item) for item in items if isinstance(item, dict)]
    loose = [item for item in items if not isinstance(item, dict)]
    if loose or not groups:
        groups.append({"params": loose})
    for group in groups:
        untagged = [p for p in group["params"] if not hasattr(p, "use_muon")]
        if untagged:
            raise ValueError(f"Muon needs every parameter tagged use_muon, and {len(untagged)} "
                             f"in model_parameters are not parameters of the model: set "
                             f"`param.use_muon = True / False` on them or pass them as part "
                             f"of the model (DeepSpeed refuses them too)")
    halves = ((True, "muon", MUON_KEYS, {"lr": spec.lr, "momentum": spec.momentum,
                                          "weight_decay": spec.weight_decay,
                                          "ns_method": spec.extra.get("ns_method", "gram")}),
              (False, "adam", ADAM_KEYS, {"lr": spec.extra.get("adam_lr", spec.lr),
                                          "betas": tuple(spec.betas), "eps": spec.eps,
                                          "weight_decay": spec.weight_decay}))
    out = []
    for index, group in enumerate(groups):
        params = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in halves:
            half = [p for p in params if bool(p.use_muon) is use_muon]
            if not half:
                continue
            options = {**defaults, **{k: v for k, v in group.items() if k in keys}}
            prefix = group.get("name") or (f"group{index}" if len(groups) > 1 else None)
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            out.append(dict(params=half, use_muon=use_muon, name=name, **options))
    return out
