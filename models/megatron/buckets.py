"""The distributed optimizer's `dp_reshardable` state (Megatron-LM's default for torch_dist)
-> one tensor per parameter.

That format saves Megatron-Core's gradient buffers as they are: per model-parallel rank
(`dp_group_idx_<pp rank x tp + tp rank>`), per buffer and bucket, a flat tensor of the
bucket's unpadded length (`...gbuf_idx_0.dtype_(...).bucket_idx_0.exp_avg`). The layout is
Megatron-Core's _ParamAndGradBuffer: the rank's parameters in reverse registration order,
each starting at a multiple of 64 elements, a bucket closed where its saved length ends.
Rebuilt here from the model's global shapes and the saved args, and checked against every
bucket's saved length: each rank's local tensors are then merged over tp as the legacy
format's shards are (legacy.py). One buffer per parameter dtype (the dtype in its key),
no virtual pipeline, layers split evenly over pp; anything else is refused.

Mixtures of experts: the routed experts are registered one by one (SequentialMLP's
local_experts: fc1 then fc2 of each). At ep 1 they sit in the one buffer with the rest; at
ep > 1 Megatron-Core runs two distributed optimizers (`chained_0.`: the rest, per tp x pp
rank; `chained_1.`: the routed experts, per rank of its expert tp x ep x pp group, each
holding its ep rank's experts), read here alike.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, require
from gigatron.models.megatron.legacy import megatron_state_dict
from gigatron.models.megatron.moe import is_routed_expert, local_experts

_BUCKET = re.compile(r"(?:chained_(\d+)\.)?optimizer\.distributed\.dp_group_idx_(\d+)\."
                     r"gbuf_idx_(\d+)\.dtype_\((torch\.\w+), torch\.\w+\)\."
                     r"bucket_idx_(\d+)\.(\w+)$")
_COLUMN = ("word_embeddings.weight", "linear_qkv.weight", "linear_qkv.bias",
           "linear_fc1.weight", "linear_fc1.bias", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_ALIGN = 64  # Megatron-Core pads each parameter's start to 64 elements
_LAYERS = "decoder.layers."


def local_shape(name: str, shape: Tuple[int, ...], tp: int) -> Tuple[int, ...]:
    """A tp rank's shape of a global tensor (column-parallel: dim 0 split, row: dim 1)."""
    if name.endswith(_COLUMN):
        return (shape[0] // tp,) + shape[1:]
    if name.endswith(_ROW):
        return (shape[0], shape[1] // tp) + shape[2:]
    return shape


Shape = Tuple[int, ...]
Tensors = Dict[str, Tuple[Shape, torch.dtype]]  # global key -> (global shape, dtype)


Param = Tuple[str, Tuple[Shape, torch.dtype]]


def _layers(model: Tensors, num_layers: int) -> List[List[Param]]:
    """Each layer's (name inside it, (shape, dtype)) in the sharded state dict's order: from
    layer-stacked tensors, or per layer as Megatron-Core saves mixtures of experts."""
    layers: List[List[Param]] = [[] for _ in range(num_layers)]
    for key, (shape, dtype) in model.items():
        if not key.startswith(_LAYERS):
            continue
        rest = key[len(_LAYERS):]
        if rest[0].isdigit():
            number, inner = rest.split(".", 1)
            layers[int(number)].append((inner, (shape, dtype)))
        else:
            for layer in layers:
                layer.append((rest, (shape[1:], dtype)))
    return layers


def rank_parameters(model: Tensors, num_layers: int, pp: int, pp_rank: int, tied: bool,
                    ep: int = 1, ep_rank: int = 0) -> List[Param]:
    """(chunk-local name, (global shape, dtype)) of a pipeline rank's parameters in
    Megatron-Core's registration order (`model`: the checkpoint's global tensors in the order
    Megatron-Core's sharded state dict lists them; routed experts: expert-parallel rank
    `ep_rank`'s, one by one)."""
    per_stage = num_layers // pp
    layers = _layers(model, num_layers)[pp_rank * per_stage:(pp_rank + 1) * per_stage]
    out: List[Param] = []
    if pp_rank == 0:
        out += [(k, v) for k, v in model.items() if k.startswith("embedding.")]
    out += [(f"{_LAYERS}{i}.{name}", shape) for i, layer in enumerate(layers)
            for name, shape in local_experts(layer, ep, ep_rank)]
    if pp_rank == pp - 1:
        out += [(k, v) for k, v in model.items() if k.startswith("decoder.final_layernorm")]
        if "output_layer.weight" in model:
            out.append(("output_layer.weight", model["output_layer.weight"]))
        elif tied and pp > 1:  # the last stage's copy of the embedding is a parameter too
            out.append(("output_layer.weight", model["embedding.word_embeddings.weight"]))
    return out


def unflatten_buckets(buckets: List[torch.Tensor], params: List[Tuple[str, Tuple[int, ...]]],
                      where: str) -> StateDict:
    """A rank's parameters cut out of its saved buckets (reverse order, 64-aligned starts)."""
    out: StateDict = {}
    index, start = 0, 0
    for name, shape in reversed(params):
        numel = int(torch.Size(shape).numel())
        if start == buckets[index].numel() and index + 1 < len(buckets):
            index, start = index + 1, 0  # a bucket ends where its last parameter ends
        start = -(-start // _ALIGN) * _ALIGN
        require(start + numel <= buckets[index].numel(), f"{where}: {name} does not fit "
                f"bucket {index} ({buckets[index].numel()} elements) as this model lays the "
                f"buffers out (add --no-load-optim to take the weights only)")
        out[name] = buckets[index][start:start + numel].view(shape)
        start += numel
    require(index == len(buckets) - 1 and start == buckets[index].numel(),
            f"{where}: the model's parameters fill {start} of bucket {index}'s "
            f"{buckets[index].numel()} elements: the buffers were laid out otherwise than "
            f"this reader knows (add --no-load-optim to take the weights only)")
    return out


Buffers = Dict[Tuple[int, str], Dict[int, torch.Tensor]]  # (gbuf, param dtype) -> buckets
Group = Tuple[int, int]  # (chained optimizer: 0 or, of an expert-parallel run, 1; its rank)


def _found_buckets(optim: Dict[str, torch.Tensor]) -> Dict[str, Dict[Group, Buffers]]:
    """state -> (optimizer, model-parallel rank) -> (buffer, its parameters' dtype) ->
    bucket -> tensor."""
    found: Dict[str, Dict[Group, Buffers]] = {}
    for key, tensor in optim.items():
        match = _BUCKET.match(key)
        if match:
            chained, group, gbuf, dtype, bucket, state = match.groups()
            found.setdefault(state, {}).setdefault((int(chained or 0), int(group)), {}) \
                .setdefault((int(gbuf), dtype), {})[int(bucket)] = tensor
    return found


def _rank_state(buffers: Buffers, params: List[Param], where: str) -> StateDict:
    """A rank's parameters out of its buffers: one buffer per parameter dtype."""
    dtypes = [dtype for _, dtype in buffers]
    require(len(set(dtypes)) == len(dtypes), f"{where}: two gradient buffers of {dtypes}")
    out: StateDict = {}
    for (_, dtype), by_bucket in sorted(buffers.items()):
        mine = [(name, shape) for name, (shape, d) in params if str(d) == dtype]
        out.update(unflatten_buckets([by_bucket[i] for i in sorted(by_bucket)], mine,
                                     f"{where} ({dtype} buffer)"))
    missing = [name for name, _ in params if name not in out]
    require(not missing, f"{where}: no gradient buffer holds {', '.join(missing[:3])}")
    return out


def _group_parameters(group: Group, model: Tensors, config: TransformerConfig,
                      sizes: Tuple[int, int, int]) -> Tuple[Tuple[int, int], List[Param]]:
    """((tp rank, pp rank), local parameters) of one optimizer's model-parallel rank: with
    ep > 1 the routed experts are a second optimizer's over tp x ep x pp (Megatron-Core's
    expert tp-pp group), the first one's the rest over tp x pp; with ep 1 all are one's."""
    tp, pp, ep = sizes
    tied = not config.untie_embeddings_and_output_weights
    chained, rank = group
    width = tp * ep if chained == 1 else tp
    ep_rank = (rank // tp) % ep if chained == 1 else 0
    tp_rank, pp_rank = rank % tp, rank // width
    params = rank_parameters(model, config.num_layers, pp, pp_rank, tied,
                             ep if chained == 1 else 1, ep_rank)
    if ep > 1:
        params = [p for p in params if is_routed_expert(p[0]) == (chained == 1)]
    return (tp_rank, pp_rank), [(name, (local_shape(name, shape, tp), dtype))
                                for name, (shape, dtype) in params]


def bucket_states(optim: Dict[str, torch.Tensor], model: Tensors, args: object,
                  config: TransformerConfig, padded: int, folder: str
                  ) -> Dict[str, StateDict]:
    """state name ('exp_avg', 'exp_avg_sq', 'param') -> gigatron's single-device state dict
    (`model`: the checkpoint's model tensors, global key -> (shape, dtype), in its order)."""
    tp, pp, ep = (int(getattr(args, name, 1) or 1) for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "expert_model_parallel_size"))
    sizes = (tp, pp, ep)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    require(vp == 1 and config.num_layers % pp == 0, f"{folder}: the dp_reshardable "
            f"optimizer state is read for an even split of layers without a virtual "
            f"pipeline only: add --no-load-optim to take the weights")
    require(getattr(args, "expert_tensor_parallel_size", None) in (None, tp), f"{folder}: "
            f"the dp_reshardable state of experts with their own tensor-parallel size is not "
            f"read: add --no-load-optim to take the weights")
    expected = [(0, r) for r in range(tp * pp)] + \
        ([(1, r) for r in range(tp * ep * pp)] if ep > 1 else [])
    out: Dict[str, StateDict] = {}
    for state, groups in _found_buckets(optim).items():
        require(sorted(groups) == expected, f"{folder}: {state} is saved for (optimizer, "
                f"model-parallel rank) {sorted(groups)}, {expected} expected for tp {tp}, "
                f"pp {pp}, ep {ep}")
        models: Dict[Tuple[int, int], List[StateDict]] = {}
        for group, buffers in sorted(groups.items()):
            where, params = _group_parameters(group, model, config, sizes)
            models.setdefault(where, [{}])[0].update(_rank_state(
                buffers, params, f"{folder} {state} of optimizer {group[0]} rank {group[1]}"))
        out[state] = megatron_state_dict(models, tp, pp, config, padded, buffers=False)
    return out
