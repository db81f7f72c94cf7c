"""Hugging Face <-> gigatron weights: GPT-2 (`GPT2LMHeadModel`), Llama (`LlamaForCausalLM`),
Mixtral (`MixtralForCausalLM`), Qwen3 (`Qwen3ForCausalLM`), Qwen3-MoE
(`Qwen3MoeForCausalLM`), DeepSeek-V3 (`DeepseekV3ForCausalLM`), DeepSeek-V2
(`DeepseekV2ForCausalLM`) and gpt-oss (`GptOssForCausalLM`).

A Hugging Face folder holds config.json and safetensors (one file or an index of shards); an
exported one also generation_config.json, and the tokenizer files when the run's tokenizer is
known (training/checkpoint/convert.py writes them through gigatron.data.tokenizer_export).
gigatron's side is a single-device GPTModel state dict (vocabulary padded as the config
says); training/checkpoint/convert.py writes and reads it as a gigatron checkpoint, which
any tp / pp layout loads.
"""
from __future__ import annotations

import json
import os
from types import ModuleType
from typing import Any, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file

from gigatron.models import hf_deepseek, hf_gpt2, hf_llama, hf_mixtral, hf_qwen3, hf_qwen3_moe
from gigatron.models import hf_gpt_oss
from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError, StateDict, require

FAMILIES: Dict[str, ModuleType] = {"gpt2": hf_gpt2, "llama": hf_llama, "mixtral": hf_mixtral,
                                   "qwen3": hf_qwen3, "qwen3_moe": hf_qwen3_moe,
                                   "deepseek_v3": hf_deepseek}
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama",
                 "MixtralForCausalLM": "mixtral", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "DeepseekV3ForCausalLM": "deepseek_v3"}
FAMILIES["gpt_oss"], ARCHITECTURES["GptOssForCausalLM"] = hf_gpt_oss, "gpt_oss"
FAMILIES["deepseek_v2"] = hf_deepseek.V2  # type: ignore[assignment]  # V3's module, V2 routing
ARCHITECTURES["DeepseekV2ForCausalLM"] = "deepseek_v2"
QK_LAYERNORM_FAMILIES = ("qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v2")  # MLA: latents'
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
GENERATION_CONFIG_FILE = "generation_config.json"
SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

__all__ = ["ConversionError", "config_from_hf", "config_to_hf", "state_dict_from_hf",
           "state_dict_to_hf", "read_hf", "write_hf", "family_of", "read_special_token_ids"]


def family_of(hf_config: Dict[str, Any]) -> str:
    """The family (a key of FAMILIES) from config.json's model_type (or architectures)."""
    family = hf_config.get("model_type")
    architectures = hf_config.get("architectures") or []
    for arch in architectures:
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
    """Hugging Face config.json dict of `config` as `family` (a key of FAMILIES)."""
    _check_family(config, family)
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
    _check_family(config, family)
    return FAMILIES[family].state_dict_to_hf(state, config)


def _check_family(config: TransformerConfig, family: str) -> None:
    """Raise unless `family` is known and can hold the model's query/key norms."""
    require(family in FAMILIES, f"family {family!r} is not supported ({', '.join(FAMILIES)})")
    require(not config.qk_layernorm or family in QK_LAYERNORM_FAMILIES,
            f"cannot export to {family}: the model normalises each head's query and key "
            f"(qk_layernorm), which {family} has no weights for: export it as "
            f"{'qwen3_moe' if config.num_moe_experts is not None else 'qwen3'}")


def default_family(config: TransformerConfig) -> str:
    """The Hugging Face family a config exports to: models with query/key norms as Qwen3 or
    Qwen3-MoE, other MoE models as Mixtral, other RoPE models as Llama, the rest as GPT-2;
    multi-latent attention as DeepSeek-V3 (softmax routing: DeepSeek-V2)."""
    if config.softmax_type == "learnable" and config.activation == "quick_geglu":
        return "gpt_oss"
    if config.multi_latent_attention:
        return "deepseek_v2" if config.moe_router_score_function == "softmax" else "deepseek_v3"
    if config.qk_layernorm:
        return "qwen3_moe" if config.num_moe_experts is not None else "qwen3"
    if config.num_moe_experts is not None:
        return "mixtral"
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


def read_hf(hf_dir: str) -> Tuple[TransformerConfig, StateDict]:
    """(config, single-device GPTModel state dict) of a Hugging Face folder."""
    return state_dict_from_hf(load_hf_state_dict(hf_dir),
                              _read_json(os.path.join(hf_dir, CONFIG_FILE)))


def _readable(path: str) -> None:
    """Give a written file the mode the umask allows (safetensors writes 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def read_special_token_ids(hf_dir: str) -> Dict[str, Optional[int]]:
    """bos/eos/pad ids of a Hugging Face folder's config.json (None where it has none)."""
    hf_config = _read_json(os.path.join(hf_dir, CONFIG_FILE))
    return {key: hf_config.get(key) for key in SPECIAL_TOKEN_IDS}


def write_hf(out_dir: str, config: TransformerConfig, state: StateDict, family: str = "",
             special_ids: Optional[Dict[str, Optional[int]]] = None) -> Dict[str, Any]:
    """Write a single-device state dict as a Hugging Face folder (config.json,
    generation_config.json, model.safetensors) of `family` (default: default_family), with
    the tokenizer's `special_ids` (bos/eos; None: unknown, written as null so that
    transformers does not assume GPT-2's or Llama's); returns the config.json."""
    family = family or default_family(config)
    hf_config = config_to_hf(config, family)
    ids = {key: (special_ids or {}).get(key) for key in SPECIAL_TOKEN_IDS}
    hf_config.update(ids)
    hf_state = state_dict_to_hf(state, config, family)
    os.makedirs(out_dir, exist_ok=True)
    weights = os.path.join(out_dir, WEIGHTS_FILE)
    save_file(hf_state, weights, metadata={"format": "pt"})
    _readable(weights)
    _write_json(os.path.join(out_dir, CONFIG_FILE), hf_config)
    _write_json(os.path.join(out_dir, GENERATION_CONFIG_FILE),
                {key: value for key, value in ids.items() if value is not None})
    return hf_config
