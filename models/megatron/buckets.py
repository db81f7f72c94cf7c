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
dense models, no virtual pipeline, layers split evenly over pp; anything else is refused.
"""
from __future__ import annotations

import re
from typing import Dict, List, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, require
from gigatron.models.megatron.legacy import megatron_state_dict

_BUCKET = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                     r"dtype_\((torch\.\w+), torch\.\w+\)\.bucket_idx_(\d+)\.(\w+)$")
_COLUMN = ("word_embeddings.weight", "linear_qkv.weight", "linear_qkv.bias",
           "linear_fc1.weight", "linear_fc1.bias", "output_layer.weight")
_ROW = ("linear_proj.weight", "linear_fc2.weight")
_ALIGN = 64  # Megatron-Core pads each parameter's start to 64 elements


def local_shape(name: str, shape: Tuple[int, ...], tp: int) -> Tuple[int, ...]:
    """A tp rank's shape of a global tensor (column-parallel: dim 0 split, row: dim 1)."""
    if name.endswith(_COLUMN):
        return (shape[0] // tp,) + shape[1:]
    if name.endswith(_ROW):
        return (shape[0], shape[1] // tp) + shape[2:]
    return shape


Shape = Tuple[int, ...]
Tensors = Dict[str, Tuple[Shape, torch.dtype]]  # global key -> (global shape, dtype)


def rank_parameters(model: Tensors, num_layers: int, pp: int, pp_rank: int, tied: bool
                    ) -> List[Tuple[str, Tuple[Shape, torch.dtype]]]:
    """(chunk-local name, (global shape, dtype)) of a pipeline rank's parameters in
    Megatron-Core's registration order (`model`: the checkpoint's global tensors,
    layer-stacked, in the order Megatron-Core's sharded state dict lists them)."""
    per_stage = num_layers // pp
    inner = [(k[len("decoder.layers."):], (s[1:], d)) for k, (s, d) in model.items()
             if k.startswith("decoder.layers.")]
    out: List[Tuple[str, Tuple[Shape, torch.dtype]]] = []
    if pp_rank == 0:
        out += [(k, v) for k, v in model.items() if k.startswith("embedding.")]
    out += [(f"decoder.layers.{i}.{name}", shape) for i in range(per_stage)
            for name, shape in inner]
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


def _found_buckets(optim: Dict[str, torch.Tensor]) -> Dict[str, Dict[int, Buffers]]:
    """state -> model-parallel rank -> (buffer, its parameters' dtype) -> bucket -> tensor."""
    found: Dict[str, Dict[int, Buffers]] = {}
    for key, tensor in optim.items():
        match = _BUCKET.match(key)
        if match:
            group, gbuf, dtype, bucket, state = match.groups()
            found.setdefault(state, {}).setdefault(int(group), {}).setdefault(
                (int(gbuf), dtype), {})[int(bucket)] = tensor
    return found


def _rank_state(buffers: Buffers, params: List[Tuple[str, Tuple[Shape, torch.dtype]]],
                where: str) -> StateDict:
    """A rank's parameters out of its buffers: one buffer per parameter dtype."""
    dtypes = [dtype for _, dtype in buffers]
    require(len(set(dtypes)) == len(dtypes), f"{where}: two gradient buffers of "
            f"{dtypes}: expert buffers (mixture of experts) are not supported")
    out: StateDict = {}
    for (_, dtype), by_bucket in sorted(buffers.items()):
        mine = [(name, shape) for name, (shape, d) in params if str(d) == dtype]
        out.update(unflatten_buckets([by_bucket[i] for i in sorted(by_bucket)], mine,
                                     f"{where} ({dtype} buffer)"))
    missing = [name for name, _ in params if name not in out]
    require(not missing, f"{where}: no gradient buffer holds {', '.join(missing[:3])}")
    return out


def bucket_states(optim: Dict[str, torch.Tensor], model: Tensors, args: object,
                  config: TransformerConfig, padded: int, folder: str
                  ) -> Dict[str, StateDict]:
    """state name ('exp_avg', 'exp_avg_sq', 'param') -> gigatron's single-device state dict
    (`model`: the checkpoint's model tensors, global key -> (shape, dtype), in its order)."""
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    require(vp == 1 and config.num_layers % pp == 0, f"{folder}: the dp_reshardable "
            f"optimizer state is read for an even split of layers without a virtual "
            f"pipeline only: add --no-load-optim to take the weights")
    tied = not config.untie_embeddings_and_output_weights
    out: Dict[str, StateDict] = {}
    for state, groups in _found_buckets(optim).items():
        require(sorted(groups) == list(range(tp * pp)), f"{folder}: {state} is saved for "
                f"model-parallel ranks {sorted(groups)}, tp x pp = {tp * pp} expected")
        models = {}
        for group, buffers in groups.items():
            tp_rank, pp_rank = group % tp, group // tp
            params = [(name, (local_shape(name, shape, tp), dtype)) for name, (shape, dtype)
                      in rank_parameters(model, config.num_layers, pp, pp_rank, tied)]
            models[(tp_rank, pp_rank)] = [_rank_state(
                buffers, params, f"{folder} {state} of tp rank {tp_rank}, pp rank {pp_rank}")]
        out[state] = megatron_state_dict(models, tp, pp, config, padded)
    return out
