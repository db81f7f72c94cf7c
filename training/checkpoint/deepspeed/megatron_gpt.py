"""A Megatron-DeepSpeed GPT checkpoint (pretrain_gpt.py with --deepspeed) under Megatron-Core's
names, which models/megatron/legacy.py turns into gigatron's model.

Megatron-DeepSpeed (megatron/model/gpt_model.py, language_model.py, transformer.py) trains
either `GPTModel`, whose parameters are named

    language_model.embedding.{word,position}_embeddings.weight
    language_model.encoder.layers.<i>.<layer name>      language_model.encoder.final_layernorm.*
    language_model.output_layer.weight                  (--untie-embeddings-and-output-weights)

or, with its DeepSpeed pipeline (the default), `GPTModelPipe`: a PipelineModule whose layers
are numbered in order (a cast function, the embedding, the transformer layers, the final
norm, the output head `lm_head.weight` or the tied embedding again), named
`<index>.<name>` (the embedding, when tied: `tied_modules.embed.<name>`). A transformer
layer's names are Megatron-LM's legacy ones; the fused QKV is laid out per query group, as
in Megatron-Core, so only the names change.
"""
from __future__ import annotations

import argparse
import re
from typing import Dict

import torch

from gigatron.models.hf_common import ConversionError, StateDict

_LAYER_NAMES = {
    "input_layernorm": "input_layernorm",
    "self_attention.query_key_value": "self_attention.linear_qkv",
    "self_attention.dense": "self_attention.linear_proj",
    "post_attention_layernorm": "pre_mlp_layernorm",
    "mlp.dense_h_to_4h": "mlp.linear_fc1",
    "mlp.dense_4h_to_h": "mlp.linear_fc2",
}
_EMBEDDINGS = {"word_embeddings.weight": "embedding.word_embeddings.weight",
               "position_embeddings.weight": "embedding.position_embeddings.weight"}
_GPT_LAYER = re.compile(r"language_model\.encoder\.layers\.(\d+)\.(.+)$")
_PIPE = re.compile(r"(\d+)\.(.+)$")
_TIED = "tied_modules.embed."


def core_state_dict(weights: StateDict) -> StateDict:
    """Megatron-Core names of a Megatron-DeepSpeed GPT's parameters (either model)."""
    if any(name.startswith("language_model.") for name in weights):
        return _from_gpt_model(weights)
    return _from_pipeline(weights)


def _layer_name(layer: int, inner: str) -> str:
    for old, new in _LAYER_NAMES.items():
        if inner.startswith(old + "."):
            return f"decoder.layers.{layer}.{new}{inner[len(old):]}"
    hint = " (mixture of experts is not supported)" if "expert" in inner else ""
    raise ConversionError(f"Megatron-DeepSpeed layer parameter {inner!r} is not understood"
                          f"{hint}")


def _from_gpt_model(weights: StateDict) -> StateDict:
    out: StateDict = {}
    for name, tensor in weights.items():
        match = _GPT_LAYER.match(name)
        rest = name[len("language_model."):]
        if match:
            out[_layer_name(int(match.group(1)), match.group(2))] = tensor
        elif rest.startswith("embedding.") and rest[len("embedding."):] in _EMBEDDINGS:
            out[_EMBEDDINGS[rest[len("embedding."):]]] = tensor
        elif rest.startswith("encoder.final_layernorm."):
            out["decoder.final_layernorm." + rest.rsplit(".", 1)[1]] = tensor
        elif rest == "output_layer.weight":
            out["output_layer.weight"] = tensor
        else:
            raise ConversionError(f"Megatron-DeepSpeed parameter {name!r} is not understood")
    return out


def _from_pipeline(weights: StateDict) -> StateDict:
    """GPTModelPipe: the layers told apart by what they hold, in index order."""
    layers: Dict[int, Dict[str, torch.Tensor]] = {}
    out: StateDict = {}
    for name, tensor in weights.items():
        if name.startswith(_TIED):
            _embedding(out, name[len(_TIED):], tensor, name)
            continue
        match = _PIPE.match(name)
        if not match:
            raise ConversionError(f"{name!r} is not a Megatron-DeepSpeed GPT parameter (neither "
                                  f"language_model.* nor a pipeline layer <index>.*)")
        layers.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    blocks = [i for i in sorted(layers) if any(k.startswith("input_layernorm.")
                                                for k in layers[i])]
    for index, names in sorted(layers.items()):
        if index in blocks:
            for inner, tensor in names.items():
                out[_layer_name(blocks.index(index), inner)] = tensor
        elif any(k in _EMBEDDINGS for k in names):
            for inner, tensor in names.items():
                _embedding(out, inner, tensor, f"{index}.{inner}")
        elif "lm_head.weight" in names:
            out["output_layer.weight"] = names["lm_head.weight"]
        elif blocks and index > blocks[-1] and set(names) <= {"weight", "bias"}:
            out.update({f"decoder.final_layernorm.{k}": v for k, v in names.items()})
        else:
            raise ConversionError(f"Megatron-DeepSpeed pipeline layer {index} ({sorted(names)}) "
                                  f"is not understood")
    return out


def _embedding(out: StateDict, inner: str, tensor: torch.Tensor, name: str) -> None:
    """The first copy of the (possibly tied) embedding wins; the output's copy is the same."""
    if inner not in _EMBEDDINGS:
        raise ConversionError(f"Megatron-DeepSpeed embedding parameter {name!r} is not "
                              f"understood")
    out.setdefault(_EMBEDDINGS[inner], tensor)


def megatron_args(args: argparse.Namespace) -> argparse.Namespace:
    """Megatron-DeepSpeed's saved args in Megatron-LM's spelling: --normalization layernorm
    / rmsnorm, grouped-query attention as --num-key-value-heads."""
    out = argparse.Namespace(**vars(args))
    norm = str(getattr(args, "normalization", None) or "layernorm").lower()
    out.normalization = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(norm, norm)
    kv_heads = getattr(args, "num_key_value_heads", None)
    if kv_heads and int(kv_heads) != int(args.num_attention_heads):
        out.group_query_attention, out.num_query_groups = True, int(kv_heads)
    return out
