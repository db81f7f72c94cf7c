"""Muon inside ZeroOptimizer: its flat groups split by rule, one torch group per flat group,
and the layer-wise plan of every Muon group's shard (Megatron's path: --optimizer muon)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, cast

import torch

from gigatron.parallel.comm import Group
from gigatron.parallel.zero.muon.config import MuonConfig
from gigatron.parallel.zero.muon.layerwise import ShardedMatrices, assign_owners, exchange_plan
from gigatron.parallel.zero.muon.matrices import is_muon_matrix, units_of
from gigatron.parallel.zero.muon.optimizer import Muon

if TYPE_CHECKING:
    from gigatron.parallel.zero.optimizer import ZeroOptimizer

MUON, SCALAR = "muon", "scalar"


def rule_of(param: torch.nn.Parameter) -> str:
    """The flat groups of a Muon run keep matrices apart from the scalar optimizer's tensors."""
    return MUON if is_muon_matrix(param) else SCALAR


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


def shard_layouts(zero: "ZeroOptimizer", config: MuonConfig) -> Dict[int, ShardedMatrices]:
    """Per Muon flat group (by its master's id): its matrices, their owners over the group's
    shards (balanced per dp group across flat groups and chunks) and this rank's exchange."""
    names = {id(p): n for chunk in zero.chunks for n, p in chunk.named_parameters()}
    loads: Dict[int, List[float]] = {}
    layouts = {}
    for g, rule in zip(zero.flat_groups, zero.flat_rule):
        if rule != MUON:
            continue
        units = units_of(g.params, names, config)
        load = loads.setdefault(id(g.dp_group) if g.ways > 1 else -1, [0.0] * g.ways)
        owners = assign_owners([u.flops(config.num_ns_steps) for u in units], g.ways, load)
        plan = exchange_plan(g.buckets, g.numels, units, owners, g.ways, g.rank_in_shard)
        layouts[id(g.master)] = ShardedMatrices(units, plan, g.dp_group, g.ways)
    return layouts
