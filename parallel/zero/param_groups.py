"""Which parameters ZeRO trains, and how they are grouped into flat buffers.

Two ways to say it:
  * Megatron's (pretrain_gpt.py; no user groups): every trainable parameter, grouped by kind
    and by "decayed or not", where only weights of 2+ dims decay.
    With Megatron's --decoupled-lr the embedding and output weights (tagged
    `is_embedding_or_output_parameter`, as Megatron-Core tags them) get groups of their own,
    expressed as param-group dicts (`megatron_param_groups`) marked "is_decoupled_lr" (the
    training loop sets their lr from the decoupled schedule).
  * DeepSpeed's (`model_parameters` of initialize, or the param groups of a user's torch
    optimizer): the user's groups, each with its own options; every parameter of a group gets
    the group's weight decay (no rule by shape). Parameters of the model in no group are not
    ZeRO's: it neither flattens, reduces, clips, steps nor (stage 3) shards them, and their
    .grad is left to autograd as in plain torch -- as DeepSpeed trains only model_parameters.
    Parameters with requires_grad=False in a group are skipped (DeepSpeed's ZeRO too).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

# What DeepSpeed's `model_parameters` may be: parameters, or torch's param-group dicts
ModelParameters = Union[Iterable[torch.Tensor], Iterable[Dict[str, Any]]]


@dataclass
class UserGroup:
    """One param group as the user gave it: its parameters and its optimizer options."""

    params: List[nn.Parameter]
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class FlatGroupPlan:
    """The parameters of one FlatGroup, in the order its buckets fill."""

    chunk: int
    kind: str
    params: List[nn.Parameter]
    weight_decay: float
    user_group: Optional[int]  # index into the user groups; None on Megatron's path
    rule: str = ""  # the update rule's name when parameters take different ones (Muon's)


def user_groups(model_parameters: ModelParameters) -> List[UserGroup]:
    """DeepSpeed's `model_parameters` (an iterable of parameters, or of param-group dicts
    `{"params": [...], "lr": ..., ...}`) as a list of groups."""
    items: List[Any] = list(model_parameters)
    if items and all(isinstance(x, dict) for x in items):
        groups = [_group_from_dict(i, d) for i, d in enumerate(items)]
    elif all(isinstance(x, torch.Tensor) for x in items):
        groups = [UserGroup(list(items))]
    else:
        raise TypeError("model_parameters must be an iterable of parameters or of param-group "
                        "dicts ({'params': [...], 'lr': ...}), not a mix or other objects")
    if not any(g.params for g in groups):
        raise ValueError("model_parameters holds no parameter: pass the parameters to train, "
                         "e.g. model.parameters()")
    _refuse_duplicates(groups)
    return groups


def _group_from_dict(index: int, group: Dict[str, Any]) -> UserGroup:
    if "params" not in group:
        raise ValueError(f"param group {index} has no 'params' key: torch's format is "
                         f"{{'params': [...], 'lr': ..., 'weight_decay': ...}}")
    params = group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    if not all(isinstance(p, torch.Tensor) for p in params):
        raise TypeError(f"param group {index}: 'params' must hold tensors (parameters)")
    return UserGroup(params, {k: v for k, v in group.items() if k != "params"})


def _refuse_duplicates(groups: List[UserGroup]) -> None:
    seen: Dict[int, int] = {}
    for i, g in enumerate(groups):
        for p in g.params:
            if id(p) in seen:
                raise ValueError(f"a parameter {tuple(p.shape)} is in param group {seen[id(p)]} "
                                 f"and again in group {i}: each parameter belongs to one group")
            seen[id(p)] = i


def groups_of_optimizer(optimizer: torch.optim.Optimizer) -> List[UserGroup]:
    """A user's torch optimizer's param groups: membership and options as the user set them."""
    return [UserGroup(list(g["params"]), {k: v for k, v in g.items() if k != "params"})
            for g in optimizer.param_groups]


def same_parameters(a: List[UserGroup], b: List[UserGroup]) -> bool:
    """Whether two groupings cover the same set of parameters."""
    return ({id(p) for g in a for p in g.params} == {id(p) for g in b for p in g.params})


def param_kind(p: nn.Parameter) -> str:
    """Which extra reduction a parameter's gradient needs besides dp (see grad_sync)."""
    if getattr(p, "shared_embedding", False):
        return "shared_embedding"
    if getattr(p, "expert_parallel", False):
        return "expert"  # reduced over the expert-data-parallel group instead of dp
    return "sequence_parallel" if getattr(p, "sequence_parallel", False) else "default"


# a parameter tag: no weight decay whatever its dims (experts' stacked biases [E, n], which
# Megatron-Core holds as one 1-D bias per expert)
NO_DECAY_ATTR = "no_weight_decay"


def decays(p: nn.Parameter) -> bool:
    """Megatron's decay rule: weights of 2+ dims decay, biases and norms do not."""
    return p.dim() >= 2 and not getattr(p, NO_DECAY_ATTR, False)


def plan_flat_groups(ordered: List[List[nn.Parameter]], groups: Optional[List[UserGroup]],
                     weight_decay: float,
                     rule_of: Optional[Callable[[nn.Parameter], str]] = None
                     ) -> List[FlatGroupPlan]:
    """Flat groups per chunk: by (kind, ndim >= 2) with Megatron's decay rule when `groups` is
    None, else by (user group, kind); and by `rule_of` (the update rule a parameter takes:
    Muon's matrices apart from the rest) when given; weights tagged FP8_PARAM_ATTR apart
    from the rest. `ordered` is each chunk's trainable
    parameters in the order backward produces their grads (buckets fill front to back)."""
    rule = rule_of or (lambda p: "")
    plans = []
    for chunk, params in enumerate(ordered):
        if groups is None:
            plans += _megatron_plans(chunk, params, weight_decay, rule)
            continue
        group_of = {id(p): i for i, g in enumerate(groups) for p in g.params}
        keyed: Dict[Tuple[int, str, bool, str], List[nn.Parameter]] = {}
        for p in params:
            if id(p) in group_of:
                keyed.setdefault((group_of[id(p)], param_kind(p), _fp8(p), rule(p)),
                                 []).append(p)
        # weight decay: the torch optimizer's group says (ZeroOptimizer reads it back)
        plans += [FlatGroupPlan(chunk, kind, ps, 0.0, index, name)
                  for (index, kind, _, name), ps in sorted(keyed.items())]
    return plans


def _megatron_plans(chunk: int, params: List[nn.Parameter], weight_decay: float,
                    rule: Callable[[nn.Parameter], str]) -> List[FlatGroupPlan]:
    keyed: Dict[Tuple[str, bool, bool, str], List[nn.Parameter]] = {}
    for p in params:
        keyed.setdefault((param_kind(p), decays(p), _fp8(p), rule(p)), []).append(p)
    return [FlatGroupPlan(chunk, kind, ps, weight_decay if decay else 0.0, None, name)
            for (kind, decay, _, name), ps in sorted(keyed.items())]


# a parameter tag: a weight --fp8-param-gather gathers in FP8; such weights get flat buffers
# of their own (as Megatron-Core's FP8 parameter buffers), so a shard is all FP8 bytes
FP8_PARAM_ATTR = "fp8_param_gather"


def _fp8(p: nn.Parameter) -> bool:
    return bool(getattr(p, FP8_PARAM_ATTR, False))


DECOUPLED_ATTR = "is_embedding_or_output_parameter"  # Megatron-Core's tag


def megatron_param_groups(chunks: Iterable[nn.Module], weight_decay: float,
                          decoupled: bool = False) -> List[Dict[str, Any]]:
    """Megatron's grouping as torch param-group dicts: weights of 2+ dims decay, others do
    not; with `decoupled`, the parameters tagged DECOUPLED_ATTR form groups of their own
    marked "is_decoupled_lr" (Megatron's key). Empty groups are left out."""
    keyed: Dict[Tuple[bool, bool], List[nn.Parameter]] = {}
    seen = set()
    for chunk in chunks:
        for p in chunk.parameters():
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            split = decoupled and bool(getattr(p, DECOUPLED_ATTR, False))
            keyed.setdefault((split, decays(p)), []).append(p)
    return [{"params": ps, "weight_decay": weight_decay if decay else 0.0,
             "is_decoupled_lr": split} for (split, decay), ps in sorted(keyed.items())]


def check_in_model(chunks: List[nn.Module], groups: Optional[List[UserGroup]]) -> None:
    """Refuse a group parameter the model does not own (ZeRO flattens only the model's)."""
    in_model = {id(p) for m in chunks for p in m.parameters()}
    for i, g in enumerate(groups or []):
        for p in g.params:
            if id(p) not in in_model:
                raise ValueError(f"param group {i} holds a parameter {tuple(p.shape)} that is "
                                 f"not a parameter of the model ZeRO wraps: pass the model's "
                                 f"own parameters")


def trainable_in(groups: Optional[List[UserGroup]],
                 params: Iterable[nn.Parameter]) -> List[nn.Parameter]:
    """The parameters ZeRO manages among `params` (requires_grad, and in a group if any)."""
    params = [p for p in params if p.requires_grad]
    if groups is None:
        return params
    member = {id(p) for g in groups for p in g.params}
    return [p for p in params if id(p) in member]
