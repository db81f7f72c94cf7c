"""GPT-2 (`GPT2LMHeadModel`) <-> gigatron: config fields and tensors, at tp=1 / pp=1.

GPT-2's Conv1D stores weights [in, out] (gigatron's linears are [out, in]) and its c_attn
holds [all q; all k; all v], where gigatron's fused qkv holds [q; k; v] per head.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import (
    StateDict,
    layer_prefix,
    pad_vocab,
    require,
    reject_true,
    unpad_vocab,
)

ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}
_LAYER_MAP = {  # gigatron name in a layer -> GPT-2 name in a block, for the plain tensors
    "input_layernorm.weight": "ln_1.weight", "input_layernorm.bias": "ln_1.bias",
    "pre_mlp_layernorm.weight": "ln_2.weight", "pre_mlp_layernorm.bias": "ln_2.bias",
}
_CONV1D_MAP = {  # Conv1D layers, transposed on the way
    "self_attention.linear_proj": "attn.c_proj", "mlp.linear_fc1": "mlp.c_fc",
    "mlp.linear_fc2": "mlp.c_proj",
}


def config_from_hf(hf: Dict[str, Any]) -> TransformerConfig:
    """TransformerConfig of a GPT-2 config.json (dropouts kept, for training on)."""
    act = hf.get("activation_function", "gelu_new")
    require(act in ACTIVATIONS, f"GPT-2 activation_function {act!r} is not supported "
            f"(supported: {', '.join(ACTIVATIONS)})")
    reject_true(hf, ("scale_attn_by_inverse_layer_idx", "add_cross_attention"), "GPT-2")
    require(hf.get("scale_attn_weights", True), "GPT-2 scale_attn_weights=false is not supported")
    require(hf.get("tie_word_embeddings", True),
            "GPT-2 tie_word_embeddings=false is not supported (GPT2LMHeadModel ties them)")
    hidden = hf["n_embd"]
    return TransformerConfig(
        num_layers=hf["n_layer"], hidden_size=hidden, num_attention_heads=hf["n_head"],
        vocab_size=hf["vocab_size"], seq_length=hf["n_positions"],
        max_position_embeddings=hf["n_positions"],
        ffn_hidden_size=hf.get("n_inner") or 4 * hidden, activation=ACTIVATIONS[act],
        normalization="LayerNorm", layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
        position_embedding_type="learned_absolute", add_bias_linear=True,
        untie_embeddings_and_output_weights=False,
        hidden_dropout=hf.get("resid_pdrop", 0.1), attention_dropout=hf.get("attn_pdrop", 0.1),
        init_method_std=hf.get("initializer_range", 0.02))


def config_to_hf(config: TransformerConfig) -> Dict[str, Any]:
    """GPT-2 config.json of a TransformerConfig; raises on what GPT-2 cannot express."""
    checks = [(config.num_moe_experts is None, "the model has MoE layers (num_moe_experts): "
               "export it as mixtral (--family mixtral)"),
              (config.position_embedding_type == "learned_absolute",
               "position_embedding_type must be 'learned_absolute'"),
              (config.normalization == "LayerNorm", "normalization must be 'LayerNorm'"),
              (config.activation in ("gelu", "gelu_tanh"), "activation must be a GeLU"),
              (config.add_bias_linear, "add_bias_linear must be true"),
              (not config.untie_embeddings_and_output_weights, "embeddings must be tied"),
              (config.num_query_groups == config.num_attention_heads, "GQA is not GPT-2"),
              (config.kv_channels * config.num_attention_heads == config.hidden_size,
               "kv_channels x heads must equal hidden_size"),
              (not config.layernorm_zero_centered_gamma,
               "zero-centred norms (--apply-layernorm-1p) have no GPT-2 equivalent")]
    for ok, message in checks:
        require(ok, f"cannot export to GPT-2: {message}")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_position_embeddings,
        "n_embd": config.hidden_size, "n_layer": config.num_layers,
        "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
        "activation_function": "gelu_new" if config.activation == "gelu_tanh" else "gelu",
        "layer_norm_epsilon": config.layernorm_epsilon, "resid_pdrop": config.hidden_dropout,
        "embd_pdrop": config.hidden_dropout, "attn_pdrop": config.attention_dropout,
        "initializer_range": config.init_method_std, "tie_word_embeddings": True,
    }


def _qkv_to_gigatron(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[3 x heads x d, ...] (q, k, v blocks) -> [heads x 3 x d, ...] (per-head q, k, v)."""
    rest = t.shape[1:]
    return t.reshape(3, heads, -1, *rest).transpose(0, 1).reshape(t.shape)


def _qkv_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    rest = t.shape[1:]
    return t.reshape(heads, 3, -1, *rest).transpose(0, 1).reshape(t.shape)


def state_dict_from_hf(hf_state: StateDict, config: TransformerConfig) -> StateDict:
    """gigatron GPTModel state dict (tp=1) from GPT2LMHeadModel tensors."""
    src = {k[len("transformer."):] if k.startswith("transformer.") else k: v
           for k, v in hf_state.items()}
    n = config.num_attention_heads
    out: StateDict = {
        "embedding.word_embeddings.weight": pad_vocab(src.pop("wte.weight"), config),
        "embedding.position_embeddings.weight": src.pop("wpe.weight"),
        "decoder.final_layernorm.weight": src.pop("ln_f.weight"),
        "decoder.final_layernorm.bias": src.pop("ln_f.bias"),
    }
    for i in range(config.num_layers):
        ours, theirs = layer_prefix(i), f"h.{i}."
        for name, hf_name in _LAYER_MAP.items():
            out[ours + name] = src.pop(theirs + hf_name)
        qkv = ours + "self_attention.linear_qkv."
        out[qkv + "weight"] = _qkv_to_gigatron(src.pop(theirs + "attn.c_attn.weight").t(), n)
        out[qkv + "bias"] = _qkv_to_gigatron(src.pop(theirs + "attn.c_attn.bias"), n)
        for name, hf_name in _CONV1D_MAP.items():
            out[f"{ours}{name}.weight"] = src.pop(f"{theirs}{hf_name}.weight").t()
            out[f"{ours}{name}.bias"] = src.pop(f"{theirs}{hf_name}.bias")
    src.pop("lm_head.weight", None)  # tied to wte
    # causal-mask buffers of older checkpoints are not parameters
    leftover = [k for k in src if not k.endswith(("attn.bias", "attn.masked_bias"))]
    require(not leftover, f"GPT-2 tensors not understood: {', '.join(sorted(leftover))}")
    return {k: v.contiguous() for k, v in out.items()}


def state_dict_to_hf(state: StateDict, config: TransformerConfig) -> StateDict:
    """GPT2LMHeadModel tensors (as save_pretrained writes them) from a gigatron state dict."""
    n = config.num_attention_heads
    wte = unpad_vocab(state["embedding.word_embeddings.weight"], config)
    out: StateDict = {
        "transformer.wte.weight": wte,
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["decoder.final_layernorm.weight"],
        "transformer.ln_f.bias": state["decoder.final_layernorm.bias"],
    }
    for i in range(config.num_layers):
        ours, theirs = layer_prefix(i), f"transformer.h.{i}."
        for name, hf_name in _LAYER_MAP.items():
            out[theirs + hf_name] = state[ours + name]
        qkv = ours + "self_attention.linear_qkv."
        out[theirs + "attn.c_attn.weight"] = _qkv_to_hf(state[qkv + "weight"], n).t()
        out[theirs + "attn.c_attn.bias"] = _qkv_to_hf(state[qkv + "bias"], n)
        for name, hf_name in _CONV1D_MAP.items():
            out[f"{theirs}{hf_name}.weight"] = state[f"{ours}{name}.weight"].t()
            out[f"{theirs}{hf_name}.bias"] = state[f"{ours}{name}.bias"]
    return {k: v.contiguous() for k, v in out.items()}
