"""Hugging Face <-> gigatron weights: GPT-2 (`GPT2LMHeadModel`) and Llama (`LlamaForCausalLM`).

A Hugging Face folder holds config.json and safetensors (one file or an index of shards).
A gigatron folder (tp=1, pp=1) holds `config.json` (the TransformerConfig's fields) and
`model.safetensors` (a full GPTModel state dict, vocabulary padded as the config says).
"""
from __future__ import annotations

import dataclasses
import json
import os
from types import ModuleType
from typing import Any, Dict, Tuple

import torch
from safetensors.torch import load_file, save_file

from gigatron.models import hf_gpt2, hf_llama
from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, StateDict, require

FAMILIES: Dict[str, ModuleType] = {"gpt2": hf_gpt2, "llama": hf_llama}
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama"}
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

__all__ = ["ConversionError", "config_from_hf", "config_to_hf", "state_dict_from_hf",
           "state_dict_to_hf", "hf_to_gigatron", "gigatron_to_hf", "load_gigatron",
           "save_gigatron", "family_of"]


def family_of(hf_config: Dict[str, Any]) -> str:
    """'gpt2' or 'llama' from config.json's model_type (or architectures)."""
    family = hf_config.get("model_type")
    for arch in hf_config.get("architectures") or []:
        require(arch in ARCHITECTURES, f"architecture {arch!r} is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})")
        family = family or ARCHITECTURES[arch]
    require(family in FAMILIES, f"model_type {family!r} is not supported "
            f"(supported: {', '.join(FAMILIES)})")
    return str(family)


def config_from_hf(hf_config: Dict[str, Any]) -> TransformerConfig:
    """TransformerConfig of a Hugging Face config.json dict."""
    return FAMILIES[family_of(hf_config)].config_from_hf(hf_config)


def config_to_hf(config: TransformerConfig, family: str) -> Dict[str, Any]:
    """Hugging Face config.json dict of `config` as `family` ('gpt2' or 'llama')."""
    require(family in FAMILIES, f"family {family!r} is not supported ({', '.join(FAMILIES)})")
    hf = FAMILIES[family].config_to_hf(config)
    hf["torch_dtype"] = str(config.params_dtype).replace("torch.", "")
    return hf


def state_dict_from_hf(hf_state: StateDict, hf_config: Dict[str, Any]
                       ) -> Tuple[TransformerConfig, StateDict]:
    """(config, GPTModel state dict at tp=1) from Hugging Face tensors and config.json."""
    module = FAMILIES[family_of(hf_config)]
    config = module.config_from_hf(hf_config)
    state = module.state_dict_from_hf(hf_state, config)
    # the gigatron model is built in the dtype the weights come in (bf16 stays bf16)
    dtype = state["embedding.word_embeddings.weight"].dtype
    require(dtype in _DTYPE_NAMES, f"weights of dtype {dtype} are not supported "
            f"(fp32, bf16, fp16)")
    config.params_dtype = dtype
    return config, state


def state_dict_to_hf(state: StateDict, config: TransformerConfig, family: str) -> StateDict:
    """Hugging Face tensors (save_pretrained's names) of a tp=1 GPTModel state dict."""
    require(family in FAMILIES, f"family {family!r} is not supported ({', '.join(FAMILIES)})")
    return FAMILIES[family].state_dict_to_hf(state, config)


def default_family(config: TransformerConfig) -> str:
    """The Hugging Face family a config exports to: RoPE models as Llama, others as GPT-2."""
    return "llama" if config.position_embedding_type == "rope" else "gpt2"


def _read_json(path: str) -> Dict[str, Any]:
    require(os.path.isfile(path), f"{path} not found")
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, data: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def load_hf_state_dict(folder: str) -> StateDict:
    """Every tensor of a Hugging Face folder's safetensors (single file or sharded index)."""
    single = os.path.join(folder, WEIGHTS_FILE)
    if os.path.isfile(single):
        return load_file(single)
    index = os.path.join(folder, WEIGHTS_FILE + ".index.json")
    require(os.path.isfile(index), f"{folder} has neither {WEIGHTS_FILE} nor {index}")
    state: StateDict = {}
    for shard in sorted(set(_read_json(index)["weight_map"].values())):
        state.update(load_file(os.path.join(folder, shard)))
    return state


def hf_to_gigatron(hf_dir: str, out_dir: str) -> TransformerConfig:
    """Convert a Hugging Face folder into a gigatron folder; returns the config."""
    config, state = state_dict_from_hf(load_hf_state_dict(hf_dir),
                                       _read_json(os.path.join(hf_dir, CONFIG_FILE)))
    save_gigatron(out_dir, config, state)
    return config


def gigatron_to_hf(checkpoint_dir: str, out_dir: str, family: str = "") -> Dict[str, Any]:
    """Convert a gigatron folder into a Hugging Face folder; returns the written config.json."""
    config, state = load_gigatron(checkpoint_dir)
    family = family or default_family(config)
    hf_config = config_to_hf(config, family)
    hf_state = state_dict_to_hf(state, config, family)
    os.makedirs(out_dir, exist_ok=True)
    save_file(hf_state, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, CONFIG_FILE), hf_config)
    return hf_config


def config_to_json(config: TransformerConfig) -> Dict[str, Any]:
    """The TransformerConfig's fields as JSON values (dtype by name)."""
    data = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    data["params_dtype"] = _DTYPE_NAMES[config.params_dtype]
    return data


def save_gigatron(folder: str, config: TransformerConfig, state: StateDict) -> None:
    """Write a gigatron folder: config.json + model.safetensors."""
    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(os.path.join(folder, CONFIG_FILE), config_to_json(config))


def load_gigatron(folder: str) -> Tuple[TransformerConfig, StateDict]:
    """(config, state dict) of a gigatron folder written by save_gigatron."""
    data = _read_json(os.path.join(folder, CONFIG_FILE))
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(data) - known)
    require(not unknown, f"{folder}/{CONFIG_FILE}: unknown TransformerConfig fields "
            f"{', '.join(unknown)}")
    weights = os.path.join(folder, WEIGHTS_FILE)
    require(os.path.isfile(weights), f"{weights} not found")
    return TransformerConfig(**data), load_file(weights)
