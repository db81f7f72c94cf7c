"""Megatron-Core mixture-of-experts checkpoints -> gigatron's MoE model (models/moe/).

Saved args: Megatron-LM's --num-experts and --moe-* flags keep Megatron-Core's
TransformerConfig names (--num-experts: `num_moe_experts`), gigatron's too, so they copy by
name; --moe-layer-freq is saved already parsed (an int or a 0/1 list per layer).

Weights (torch_dist, Megatron-Core 0.16): whatever the experts' module (SequentialMLP, the
legacy GroupedMLP, TEGroupedMLP) and the expert-parallel size, the routed experts of layer i
are global tensors with an expert axis in global expert order:

    decoder.layers.<i>.mlp.experts.experts.linear_fc1.weight   [E, 2f, h]  SwiGLU: [gate; up]
    decoder.layers.<i>.mlp.experts.experts.linear_fc2.weight   [E, h, f]

or, saved with singleton local shards, one tensor per expert (`...experts.experts.<e>.
linear_fc1.weight`, stacked here). gigatron keeps them as `mlp.experts.weight1` [E, h, 2f]
([gate, up] along the last axis) and `weight2` [E, f, h]: each expert's matrix transposed.
The router (`mlp.router.weight` [E, h], `expert_bias` [E]) and the shared experts
(`mlp.shared_experts.linear_fc1/fc2.weight`) keep their names. Dense layers of a
--moe-layer-freq mix are read as any dense layer.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from typing import Any, Dict, List, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, require

_EXPERT = re.compile(r"^(.*\.mlp\.)experts\.experts\.(?:(\d+)\.)?linear_fc([12])\.weight$")
_GIGATRON_WEIGHT = {"1": "experts.weight1", "2": "experts.weight2"}
# gigatron runs only these dispatchers; any other (flex, DeepEP) routes to the same numbers
_DISPATCHERS = ("allgather", "alltoall")
# Megatron-Core's router buffer of the current step's token counts: no weight
_NOT_WEIGHTS = (".mlp.router.local_tokens_per_expert",)
_BUFFERS = ("mlp.router.expert_bias", "mlp.router.local_tokens_per_expert")


def moe_config_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """gigatron TransformerConfig fields of the saved --num-experts / --moe-* args ({} for
    a dense model); a saved None keeps gigatron's (Megatron-Core's) default."""
    experts = getattr(args, "num_experts", None)
    if not experts:
        return {}
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    fields: Dict[str, Any] = {"num_moe_experts": int(experts)}
    for name, value in vars(args).items():
        if name.startswith("moe_") and name in names and value is not None:
            fields[name] = list(value) if isinstance(value, (list, tuple)) else value
    if fields.get("moe_token_dispatcher_type") not in _DISPATCHERS:
        fields.pop("moe_token_dispatcher_type", None)
    return fields


def is_routed_expert(inner: str) -> bool:
    """Whether a layer's tensor name is Megatron-Core's routed experts' (all, or one)."""
    return _EXPERT.match("." + inner) is not None


def experts_to_gigatron(state: StateDict) -> StateDict:
    """The routed experts' tensors of a Megatron-Core state (global, one per layer or per
    expert) under gigatron's names and layout; every other tensor as it was."""
    out: StateDict = {}
    per_expert: Dict[str, Dict[int, torch.Tensor]] = {}
    for key, tensor in state.items():
        match = _EXPERT.match(key)
        if key.endswith(_NOT_WEIGHTS):
            continue
        if match is None:
            out[key] = tensor
            continue
        name = match.group(1) + _GIGATRON_WEIGHT[match.group(3)]
        if match.group(2) is None:
            out[name] = tensor.transpose(1, 2)
        else:
            per_expert.setdefault(name, {})[int(match.group(2))] = tensor
    for name, experts in per_expert.items():
        ids = sorted(experts)
        require(ids == list(range(len(ids))), f"{name}: experts {ids} saved, 0..{len(ids) - 1} "
                f"expected (a checkpoint missing an expert-parallel rank's files?)")
        out[name] = torch.stack([experts[e].t() for e in ids])
    return {k: v.contiguous() for k, v in out.items()}


def moe_layer_names() -> List[str]:
    """Names inside an MoE layer that Megatron-Core and gigatron share (the routed experts'
    are renamed by experts_to_gigatron)."""
    return ["mlp.router.weight", "mlp.router.expert_bias",
            "mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]


Entry = Tuple[str, Tuple[Tuple[int, ...], torch.dtype]]  # name -> (shape, dtype)


def local_experts(layer: List[Entry], ep: int, ep_rank: int) -> List[Entry]:
    """One layer's tensors with its stacked routed experts ([E, out, in]) replaced by
    expert-parallel rank `ep_rank`'s experts one by one, fc1 then fc2 of each: Megatron-Core's
    registration order (SequentialMLP's local_experts), named by global expert id."""
    shapes = dict(layer)
    out: List[Entry] = []
    for name, (shape, dtype) in layer:
        match = _EXPERT.match("." + name)
        if name.endswith(_BUFFERS):
            continue  # in the model's state, in no gradient buffer
        if match is None:
            out.append((name, (shape, dtype)))
            continue
        require(match.group(2) is None, f"{name}: experts saved one tensor each (singleton "
                f"local shards) are not laid out into buckets here: add --no-load-optim")
        if match.group(3) == "2":
            continue  # placed beside its fc1
        fc2 = name.replace("linear_fc1", "linear_fc2")
        count = shape[0] // ep
        for e in range(ep_rank * count, (ep_rank + 1) * count):
            for key, (full, kind) in ((name, (shape, dtype)), (fc2, shapes[fc2])):
                out.append((key.replace("experts.experts.", f"experts.experts.{e}."),
                            (full[1:], kind)))
    return out
