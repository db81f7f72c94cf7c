"""Qwen3 (`Qwen3ForCausalLM`) <-> gigatron: config fields and tensors, at tp=1 / pp=1.

Qwen3 is Llama (models/hf_llama.py maps everything else) with a norm of each head's query
and key: `self_attn.q_norm` / `k_norm`, RMSNorm over head_dim with one weight [head_dim]
shared by the heads, applied before RoPE -- Megatron-Core's qk_layernorm (`--qk-layernorm`),
gigatron's `self_attention.q_layernorm` / `k_layernorm`, with the model's eps (rms_norm_eps).
Its head_dim is a key of its own (128 for every published size, not hidden / heads): it is
gigatron's kv_channels.

Refused in one line: attention_bias (q/k/v/o biases without MLP biases: gigatron's
add_bias_linear is one switch for every linear), sliding-window layers (gigatron attends to
the whole sequence), rope types other than default and llama3. Exports write Qwen3's keys
with every layer full attention.
"""
from __future__ import annotations

from typing import Any, Dict, List

from gigatron.models import hf_llama
from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, layer_prefix, require

FAMILY = "Qwen3"


def _sliding_layers(hf: Dict[str, Any]) -> List[int]:
    """The layers transformers runs with a sliding window: `layer_types` where the
    config.json has them, else Qwen3's rule (use_sliding_window: layers from
    max_window_layers on; Qwen3-MoE has no max_window_layers, so every layer)."""
    if hf.get("layer_types"):
        return [i for i, kind in enumerate(hf["layer_types"]) if kind == "sliding_attention"]
    if not hf.get("use_sliding_window", False) or hf.get("sliding_window") is None:
        return []
    return list(range(hf.get("max_window_layers", 0), hf["num_hidden_layers"]))


def config_fields(hf: Dict[str, Any], family: str = FAMILY) -> Dict[str, Any]:
    """TransformerConfig fields of a Qwen3-shaped config.json (Qwen3-MoE's too: `family`
    names it in the errors): Llama's, with qk_layernorm."""
    bias = hf.get("attention_bias", False)
    require(not bias, f"{family} attention_bias={bias} is not supported: gigatron's "
            f"add_bias_linear would put biases on the MLP too (set it to false)")
    window, sliding = hf.get("sliding_window"), _sliding_layers(hf)
    require(not sliding or window is None or window >= hf["max_position_embeddings"],
            f"{family} sliding_window={window} on layers {sliding} is not supported: gigatron "
            f"attends to the whole sequence (set use_sliding_window to false)")
    return {**hf_llama.config_fields(hf, family), "qk_layernorm": True}


def config_from_hf(hf: Dict[str, Any]) -> TransformerConfig:
    """TransformerConfig of a Qwen3 config.json."""
    return TransformerConfig(**config_fields(hf))


def shared_config_to_hf(config: TransformerConfig, family: str) -> Dict[str, Any]:
    """The config.json keys Qwen3 shares with Qwen3-MoE: all but the MLP's; raises, naming
    `family`, on what they cannot express."""
    require(config.qk_layernorm, f"cannot export to {family}: its attention normalises each "
            f"head's query and key (q_norm, k_norm) and the model has no qk_layernorm: export "
            f"it as {'mixtral' if config.num_moe_experts is not None else 'llama'}")
    require(not config.add_bias_linear, f"cannot export to {family}: its MLPs have no biases "
            f"(add_bias_linear)")
    return {**hf_llama.shared_config_to_hf(config, family), "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None}


def config_to_hf(config: TransformerConfig) -> Dict[str, Any]:
    """Qwen3 config.json of a TransformerConfig; raises on what Qwen3 cannot express."""
    require(config.num_moe_experts is None, "cannot export to Qwen3: the model has MoE layers "
            "(num_moe_experts): export it as qwen3_moe (--family qwen3_moe)")
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            **shared_config_to_hf(config, FAMILY),
            "intermediate_size": config.ffn_hidden_size, "max_window_layers": config.num_layers,
            "layer_types": ["full_attention"] * config.num_layers}


def qk_norms_from_hf(src: StateDict, i: int, family: str = FAMILY) -> StateDict:
    """Layer i's q_norm / k_norm -> q_layernorm / k_layernorm (popped from `src`)."""
    ours, theirs = layer_prefix(i) + "self_attention.", f"model.layers.{i}.self_attn."
    out = {}
    for p in "qk":
        name = f"{theirs}{p}_norm.weight"
        require(name in src, f"{family} tensor {name} is missing")
        out[f"{ours}{p}_layernorm.weight"] = src.pop(name)
    return out


def qk_norms_to_hf(state: StateDict, i: int) -> StateDict:
    """Layer i's q_layernorm / k_layernorm as q_norm / k_norm."""
    ours, theirs = layer_prefix(i) + "self_attention.", f"model.layers.{i}.self_attn."
    return {f"{theirs}{p}_norm.weight": state[f"{ours}{p}_layernorm.weight"] for p in "qk"}


def _layer_from_hf(src: StateDict, i: int, config: TransformerConfig) -> StateDict:
    return {**qk_norms_from_hf(src, i), **hf_llama.dense_mlp_from_hf(src, i, config)}


def _layer_to_hf(state: StateDict, i: int, config: TransformerConfig) -> StateDict:
    return {**qk_norms_to_hf(state, i), **hf_llama.dense_mlp_to_hf(state, i, config)}


def state_dict_from_hf(hf_state: StateDict, config: TransformerConfig) -> StateDict:
    """gigatron GPTModel state dict (tp=1) from Qwen3ForCausalLM tensors."""
    return hf_llama.state_dict_from_hf(hf_state, config, _layer_from_hf, FAMILY)


def state_dict_to_hf(state: StateDict, config: TransformerConfig) -> StateDict:
    """Qwen3ForCausalLM tensors (save_pretrained's names) from a gigatron state dict."""
    return hf_llama.state_dict_to_hf(state, config, _layer_to_hf)

