"""Muon inside ZeroOptimizer: its flat groups split by rule, one torch group per flat group,
and the layer-wise plan of every Muon group's shard (Megatron's path: --optimizer muon); or
DeepSpeed's `"type": "Muon"` (gigatron.initialize): one torch group per user group (the
engine splits each into its use_muon halves, as DeepSpeed), DeepSpeed's rule (deepspeed.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, cast

import torch

from gigatron.parallel.comm import Group
from gigatron.parallel.zero.muon.config import MuonConfig
from gigatron.parallel.zero.muon.deepspeed import deepspeed_units
from gigatron.parallel.zero.muon.layerwise import ShardedMatrices, assign_owners, exchange_plan
from gigatron.parallel.zero.muon.matrices import is_muon_matrix, units_of
from gigatron.parallel.zero.muon.optimizer import Muon

if TYPE_CHECKING:
    from gigatron.parallel.zero.optimizer import ZeroOptimizer
    from gigatron.parallel.zero.optimizers import OptimizerSpec

MUON, SCALAR = "muon", "scalar"


def rule_of(param: torch.nn.Parameter) -> str:
    """The flat groups of a Muon run keep matrices apart from the scalar optimizer's tensors."""
    return MUON if is_muon_matrix(param) else SCALAR


def tagged_rule_of(param: torch.nn.Parameter) -> str:
    """DeepSpeed's: the `use_muon` tag the engine set (deepspeed.set_optimizer_flags' rule)."""
    return MUON if getattr(param, "use_muon", False) else SCALAR


def build_deepspeed_muon(zero: "ZeroOptimizer", spec: "OptimizerSpec") -> Muon:
    """DeepSpeed's MuonWithAuxAdam over `zero`'s master shards: one torch group per user
    group (its options: lr, momentum, ns_method, betas, eps, weight_decay, use_muon)."""
    assert zero.user_groups is not None
    config = MuonConfig(momentum=spec.momentum, nesterov=True, coefficient_type="simple",
                        scale_mode="shape_scaling", fp32_matmul_prec="highest")
    groups = []
    for i, user in enumerate(zero.user_groups):
        masters = [g.master for g, u in zip(zero.flat_groups, zero.flat_user_group) if u == i]
        groups.append({**user.options, "params": masters})
    muon = Muon(groups, lr=spec.lr, weight_decay=spec.weight_decay, config=config,
                betas=(spec.betas[0], spec.betas[1]), eps=spec.eps, decoupled=spec.adam_w_mode,
                ns_method=str(spec.extra.get("ns_method", "gram")))
    muon.set_layouts(shard_layouts(zero, config, deepspeed=True))
    muon.updates_before_norm = zero.stage >= 1
    return muon


def updates_into_grads(zero: "ZeroOptimizer", scale: float) -> None:
    """DeepSpeed's ZeRO 1-3: every Muon shard's gradient becomes its update (times the loss
    scale, which the norm and the unscale then divide out) before the norm and the clip."""
    muon = zero.optimizer
    assert isinstance(muon, Muon)
    for g, rule in zip(zero.flat_groups, zero.flat_rule):
        if rule != MUON:
            continue
        pieces = g.grad_shard_pieces()
        grad = torch.cat([p.reshape(-1).float() for p in pieces])
        update = muon.update_of(g.master, grad.view_as(g.master) / scale if scale != 1.0
                                else grad.view_as(g.master)).reshape(-1)
        at = 0
        for piece in pieces:
            piece.view(-1).copy_(update[at:at + piece.numel()] * scale)
            at += piece.numel()


def build_muon(zero: "ZeroOptimizer") -> Muon:
    """The Muon optimizer over `zero`'s master shards (AdamW for its scalar groups)."""
    from gigatron.parallel.zero.optimizers import _fusable

    c = zero.config
    config = c.muon or MuonConfig()
    groups: List[Dict[str, Any]] = []
    users = zero.user_groups or []
    for g, user, rule in zip(zero.flat_groups, zero.flat_user_group, zero.flat_rule):
        options = {} if user is None else dict(users[user].options)
        groups.append({**options, "params": [g.master], "use_muon": rule == MUON,
                       "weight_decay": options.get("weight_decay", g.weight_decay)})
    adam = {"fused": True} if _fusable(groups) else {}
    muon = Muon(groups, lr=c.lr, weight_decay=c.weight_decay, config=config,
                betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps,
                tp_group=cast(Group, zero.process_groups.tp),
                expert_tp_group=zero.process_groups.expert_tp, adam_kwargs=adam)
    muon.set_layouts(shard_layouts(zero, config))
    return muon


def shard_layouts(zero: "ZeroOptimizer", config: MuonConfig,
                  deepspeed: bool = False) -> Dict[int, ShardedMatrices]:
    """Per Muon flat group (by its master's id): its matrices (Megatron-Core's, or DeepSpeed's
    with `deepspeed`), their owners over the group's shards (balanced per dp group across
    flat groups and chunks) and this rank's exchange."""
    names = {id(p): n for chunk in zero.chunks for n, p in chunk.named_parameters()}
    loads: Dict[int, List[float]] = {}
    layouts = {}
    for g, rule in zip(zero.flat_groups, zero.flat_rule):
        if rule != MUON:
            continue
        units = deepspeed_units(g.params) if deepspeed else units_of(g.params, names, config)
        load = loads.setdefault(id(g.dp_group) if g.ways > 1 else -1, [0.0] * g.ways)
        owners = assign_owners([u.flops(config.num_ns_steps) for u in units], g.ways, load)
        plan = exchange_plan(g.buckets, g.numels, units, owners, g.ways, g.rank_in_shard)
        layouts[id(g.master)] = ShardedMatrices(units, plan, g.dp_group, g.ways)
    return layouts
