"""Llama (`LlamaForCausalLM`) <-> gigatron: config fields and tensors, at tp=1 / pp=1.

Hugging Face's Llama already uses the rotate-half RoPE layout gigatron uses, so q and k need
no permutation; only the fusions differ: gigatron's qkv holds, per query group, that group's
query heads then its k and v head, and its SwiGLU fc1 holds [gate; up].
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, layer_prefix, pad_vocab, require, unpad_vocab

# Llama 3.1's rope_scaling keys -> TransformerConfig fields (absent keys: the fields' defaults)
LLAMA3_SCALING = {"factor": "rope_scaling_factor",
                  "low_freq_factor": "rope_scaling_low_freq_factor",
                  "high_freq_factor": "rope_scaling_high_freq_factor",
                  "original_max_position_embeddings":
                      "rope_scaling_original_max_position_embeddings"}
_PLAIN = {  # gigatron name in a layer -> HF name in a layer
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
}
# a layer's MLP tensors one way: (tensors, layer number, config) -> the other side's tensors
# (from_hf pops what it maps from the Hugging Face tensors; an MoE family brings its own)
MLPMap = Callable[[StateDict, int, TransformerConfig], StateDict]


def _rope(hf: Dict[str, Any], family: str) -> Tuple[float, Optional[Dict[str, Any]]]:
    """(theta, scaling dict or None) from either transformers 4's rope_theta/rope_scaling or
    transformers 5's rope_parameters."""
    params = dict(hf.get("rope_parameters") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return theta, None
    require(kind == "llama3", f"{family} rope_type {kind!r} is not supported (default, llama3)")
    return theta, scaling


def _scaling_fields(scaling: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """TransformerConfig's rope-scaling fields of a llama3 rope_scaling dict."""
    if scaling is None:
        return {}
    fields: Dict[str, Any] = {"rope_scaling": True}
    for key, name in LLAMA3_SCALING.items():
        if scaling.get(key) is not None:
            cast = int if key == "original_max_position_embeddings" else float
            fields[name] = cast(scaling[key])
    return fields


def config_from_hf(hf: Dict[str, Any]) -> TransformerConfig:
    """TransformerConfig of a Llama config.json."""
    return TransformerConfig(**config_fields(hf))


def config_fields(hf: Dict[str, Any], family: str = "Llama") -> Dict[str, Any]:
    """TransformerConfig fields of a Llama-shaped config.json (Mixtral's too: `family` names
    it in the errors)."""
    act = hf.get("hidden_act", "silu")
    require(act == "silu", f"{family} hidden_act {act!r} is not supported (silu: SwiGLU)")
    attn_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    require(attn_bias == mlp_bias, f"{family} attention_bias={attn_bias} with "
            f"mlp_bias={mlp_bias} is not supported (gigatron has one add_bias_linear)")
    require(hf.get("pretraining_tp", 1) == 1, f"{family} pretraining_tp != 1 is not supported")
    theta, scaling = _rope(hf, family)
    heads = hf["num_attention_heads"]
    return dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // heads,
        vocab_size=hf["vocab_size"], seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"],
        ffn_hidden_size=hf["intermediate_size"], activation="swiglu", normalization="RMSNorm",
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6), position_embedding_type="rope",
        rotary_base=float(theta), **_scaling_fields(scaling), add_bias_linear=bool(attn_bias),
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02), apply_scaled_init=False)


def config_to_hf(config: TransformerConfig) -> Dict[str, Any]:
    """Llama config.json of a TransformerConfig; raises on what Llama cannot express."""
    require(config.num_moe_experts is None, "cannot export to Llama: the model has MoE layers "
            "(num_moe_experts): export it as mixtral (--family mixtral)")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            **shared_config_to_hf(config, "Llama"),
            "intermediate_size": config.ffn_hidden_size,
            "attention_bias": config.add_bias_linear, "mlp_bias": config.add_bias_linear}


def shared_config_to_hf(config: TransformerConfig, family: str) -> Dict[str, Any]:
    """The config.json keys Llama shares with its relatives (Mixtral): all but the MLP's;
    raises, naming `family`, on what they cannot express."""
    checks = [(config.position_embedding_type == "rope", "position_embedding_type must be rope"),
              (config.normalization == "RMSNorm", "normalization must be RMSNorm"),
              (config.activation == "swiglu", "activation must be swiglu"),
              (config.rotary_percent == 1.0, "rotary_percent must be 1"),
              (config.rotary_seq_len_interpolation_factor is None,
               f"rotary_seq_len_interpolation_factor has no {family} equivalent"),
              (not config.layernorm_zero_centered_gamma,
               f"zero-centred norms (--apply-layernorm-1p) have no {family} equivalent")]
    for ok, message in checks:
        require(ok, f"cannot export to {family}: {message}")
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": config.rotary_base}
    if config.rope_scaling:
        rope = {"rope_type": "llama3", "rope_theta": config.rotary_base,
                **{key: getattr(config, name) for key, name in LLAMA3_SCALING.items()}}
    return {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "hidden_act": "silu", "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.layernorm_epsilon, "rope_theta": config.rotary_base,
        "rope_parameters": rope, "attention_dropout": config.attention_dropout,
        "initializer_range": config.init_method_std,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
    }


def _qkv_shapes(config: TransformerConfig) -> Tuple[int, int, int]:
    return (config.num_query_groups, config.num_attention_heads // config.num_query_groups,
            config.kv_channels)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              config: TransformerConfig) -> torch.Tensor:
    """q [n d, ...], k and v [g d, ...] -> gigatron's [g (hpg + 2) d, ...]."""
    g, hpg, d = _qkv_shapes(config)
    rest = q.shape[1:]
    parts = [q.reshape(g, hpg, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)]
    return torch.cat(parts, dim=1).reshape(g * (hpg + 2) * d, *rest)


def _split_qkv(t: torch.Tensor, config: TransformerConfig) -> Tuple[torch.Tensor, ...]:
    g, hpg, d = _qkv_shapes(config)
    rest = t.shape[1:]
    q, k, v = t.reshape(g, hpg + 2, d, *rest).split([hpg, 1, 1], dim=1)
    return q.reshape(g * hpg * d, *rest), k.reshape(g * d, *rest), v.reshape(g * d, *rest)


def _suffixes(config: TransformerConfig) -> Tuple[str, ...]:
    return ("weight", "bias") if config.add_bias_linear else ("weight",)


def dense_mlp_from_hf(src: StateDict, i: int, config: TransformerConfig) -> StateDict:
    """Layer i's SwiGLU MLP: gate_proj, up_proj -> fc1 [gate; up], down_proj -> fc2."""
    ours, theirs = layer_prefix(i) + "mlp.", f"model.layers.{i}.mlp."
    out = {}
    for s in _suffixes(config):
        gate, up = (src.pop(f"{theirs}{p}_proj.{s}") for p in ("gate", "up"))
        out[f"{ours}linear_fc1.{s}"] = torch.cat([gate, up])
        out[f"{ours}linear_fc2.{s}"] = src.pop(f"{theirs}down_proj.{s}")
    return out


def dense_mlp_to_hf(state: StateDict, i: int, config: TransformerConfig) -> StateDict:
    """Layer i's SwiGLU MLP as gate_proj, up_proj, down_proj."""
    ours, theirs = layer_prefix(i) + "mlp.", f"model.layers.{i}.mlp."
    out = {}
    for s in _suffixes(config):
        gate, up = state[f"{ours}linear_fc1.{s}"].chunk(2)
        out[f"{theirs}gate_proj.{s}"], out[f"{theirs}up_proj.{s}"] = gate, up
        out[f"{theirs}down_proj.{s}"] = state[f"{ours}linear_fc2.{s}"]
    return out


def state_dict_from_hf(hf_state: StateDict, config: TransformerConfig,
                       mlp_from_hf: MLPMap = dense_mlp_from_hf, family: str = "Llama"
                       ) -> StateDict:
    """gigatron GPTModel state dict (tp=1) from LlamaForCausalLM tensors (`mlp_from_hf`: a
    layer's MLP, for families that differ from Llama only there)."""
    src = dict(hf_state)
    out: StateDict = {
        "embedding.word_embeddings.weight": pad_vocab(src.pop("model.embed_tokens.weight"),
                                                      config),
        "decoder.final_layernorm.weight": src.pop("model.norm.weight"),
    }
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad_vocab(src.pop("lm_head.weight"), config)
    else:
        src.pop("lm_head.weight", None)
    for i in range(config.num_layers):
        ours, theirs = layer_prefix(i), f"model.layers.{i}."
        for name, hf_name in _PLAIN.items():
            out[ours + name] = src.pop(theirs + hf_name)
        for s in _suffixes(config):
            q, k, v = (src.pop(f"{theirs}self_attn.{p}_proj.{s}") for p in "qkv")
            out[f"{ours}self_attention.linear_qkv.{s}"] = _fuse_qkv(q, k, v, config)
        if config.add_bias_linear:
            out[ours + "self_attention.linear_proj.bias"] = src.pop(
                theirs + "self_attn.o_proj.bias")
        out.update(mlp_from_hf(src, i, config))
    leftover = [k for k in src if not k.endswith("rotary_emb.inv_freq")]
    require(not leftover, f"{family} tensors not understood: {', '.join(sorted(leftover))}")
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_to_hf(state: StateDict, config: TransformerConfig,
                     mlp_to_hf: MLPMap = dense_mlp_to_hf) -> StateDict:
    """LlamaForCausalLM tensors from a gigatron state dict (tp=1) (`mlp_to_hf`: a layer's
    MLP, for families that differ from Llama only there)."""
    out: StateDict = {
        "model.embed_tokens.weight": unpad_vocab(state["embedding.word_embeddings.weight"],
                                                 config),
        "model.norm.weight": state["decoder.final_layernorm.weight"],
    }
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = unpad_vocab(state["output_layer.weight"], config)
    for i in range(config.num_layers):
        ours, theirs = layer_prefix(i), f"model.layers.{i}."
        for name, hf_name in _PLAIN.items():
            out[theirs + hf_name] = state[ours + name]
        for s in _suffixes(config):
            q, k, v = _split_qkv(state[f"{ours}self_attention.linear_qkv.{s}"], config)
            out.update({f"{theirs}self_attn.{p}_proj.{s}": t for p, t in zip("qkv", (q, k, v))})
        if config.add_bias_linear:
            out[theirs + "self_attn.o_proj.bias"] = state[ours + "self_attention.linear_proj.bias"]
        out.update(mlp_to_hf(state, i, config))
    return {k: v.contiguous() for k, v in out.items()}
