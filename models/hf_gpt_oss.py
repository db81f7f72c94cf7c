"""gpt-oss (`GptOssForCausalLM`) <-> gigatron: config fields and tensors, at tp=1 / pp=1.

- attention: Llama's q/k/v/o projections with biases (`attention_bias`, which gpt-oss always
  sets) and `self_attn.sinks` [heads], gigatron's `core_attention.softmax_offset`
  (--softmax-type learnable); `layer_types` "sliding_attention" layers have Hugging Face's
  `sliding_window` W, which lets a query see W keys, itself included: Megatron's window_size
  (W-1, 0), and the layers become --window-attn-skip-freq (2 when they alternate from the
  first, as gpt-oss; else a 0/1 list);
- RoPE: `rope_parameters` yarn (factor, original context, beta fast/slow, `truncate` as
  --no-yarn-correction-range-round-to-int; transformers' concentration 0.1 ln(factor) + 1
  is Megatron-Core's mscale 1 / mscale_all_dim 0) or default;
- MLP: every layer MoE; the router `mlp.router.weight` [E, h] and `bias` [E], top-k of the
  logits then their softmax (Megatron-Core's softmax after top-k); the experts' fused
  `gate_up_proj` [E, h, 2f] (and `gate_up_proj_bias` [E, 2f]) interleave gate and linear
  columns (gate = [..., ::2]), gigatron's `weight1` [E, h, 2f] stacks [gate, linear];
  `down_proj` [E, f, h] and `down_proj_bias` [E, h] are `weight2` and `bias2`. The gate is
  quick GeLU (`swiglu_alpha` 1.702) with offset 1 (gpt-oss's `up + 1`) and clamp
  `swiglu_limit`.

The published checkpoints store the experts in MXFP4 (`quantization_config` mxfp4, tensors
`*_blocks` / `*_scales`): refused in one line; dequantize to bf16 first.
"""
from __future__ import annotations

from typing import Any, Dict, List, Union

import torch

from gigatron.models import hf_llama
from gigatron.models.attention_kinds import is_window_layer
from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, layer_prefix, require

FAMILY = "gpt-oss"
QUICK_GELU_ALPHA = 1.702
_YARN = {"factor": "rotary_scaling_factor",
         "original_max_position_embeddings": "original_max_position_embeddings",
         "beta_fast": "beta_fast", "beta_slow": "beta_slow"}
MXFP4 = ("gpt-oss checkpoints with MXFP4 expert weights are not read: dequantize them to "
         "bf16 first (transformers: GptOssForCausalLM.from_pretrained(folder, "
         "quantization_config=Mxfp4Config(dequantize=True)).save_pretrained(new_folder)) and "
         "convert that folder")


def _layer_types(hf: Dict[str, Any]) -> List[str]:
    return hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention"
        for i in range(hf["num_hidden_layers"])]


def _window_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    sliding = [int(kind == "sliding_attention") for kind in _layer_types(hf)]
    window = hf.get("sliding_window")
    if not any(sliding) or window is None:
        return {}
    pattern: Union[int, List[int]] = sliding
    if sliding == [int((i + 1) % 2 != 0) for i in range(len(sliding))]:
        pattern = 2  # Megatron's skip freq 2: layers 2, 4, ... (1-based) full
    return {"window_size": (int(window) - 1, 0), "window_attn_skip_freq": pattern}


def _rope_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    fields: Dict[str, Any] = {"rotary_base": float(params.get("rope_theta",
                                                              hf.get("rope_theta", 150000.0)))}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return dict(fields, rope_type="rope")
    require(kind == "yarn", f"{FAMILY} rope_type {kind!r} is not supported (default, yarn)")
    require(params.get("attention_factor") is None and not params.get("mscale")
            and not params.get("mscale_all_dim"), f"{FAMILY} yarn attention_factor / mscale "
            f"are not supported: gigatron uses transformers' 0.1 ln(factor) + 1")
    fields.update(rope_type="yarn", mscale=1.0, mscale_all_dim=0.0,
                  yarn_correction_range_round_to_int=bool(params.get("truncate", True)))
    for key, name in _YARN.items():
        if params.get(key) is not None:
            fields[name] = (int if key == "original_max_position_embeddings" else float)(
                params[key])
    return fields


def config_from_hf(hf: Dict[str, Any]) -> TransformerConfig:
    """TransformerConfig of a gpt-oss config.json."""
    quant = (hf.get("quantization_config") or {}).get("quant_method")
    require(quant is None, MXFP4 if quant == "mxfp4" else
            f"{FAMILY} quantization {quant!r} is not supported: dequantize first")
    require(hf.get("attention_bias", True), f"{FAMILY} attention_bias=false is not supported "
            f"(gigatron's add_bias_linear also puts biases on the router and experts, which "
            f"gpt-oss always has)")
    alpha = hf.get("swiglu_alpha", QUICK_GELU_ALPHA)
    require(alpha == QUICK_GELU_ALPHA, f"{FAMILY} swiglu_alpha={alpha} is not supported: "
            f"quick GeLU's 1.702 (--quick-geglu)")
    # Llama's fields, without its reading of the activation, biases and RoPE (gpt-oss's below)
    fields = hf_llama.config_fields({**hf, "hidden_act": "silu", "mlp_bias": True,
                                     "attention_bias": True, "rope_scaling": None,
                                     "rope_parameters": {"rope_type": "default"}}, FAMILY)
    fields.update(**_rope_fields(hf), **_window_fields(hf))
    fields.update(
        activation="quick_geglu", glu_linear_offset=1.0,
        activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)),
        softmax_type="learnable", layernorm_epsilon=hf.get("rms_norm_eps", 1e-5),
        num_moe_experts=hf["num_local_experts"], moe_ffn_hidden_size=hf["intermediate_size"],
        moe_router_topk=hf["num_experts_per_tok"], moe_router_score_function="softmax",
        moe_router_pre_softmax=False, moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))
    return TransformerConfig(**fields)


def config_to_hf(config: TransformerConfig) -> Dict[str, Any]:
    """gpt-oss config.json of a TransformerConfig; raises on what gpt-oss cannot express."""
    c = config
    window = c.window_size
    checks = [
        (c.num_moe_experts is not None and c.moe_layer_freq == 1, "every layer must be MoE"),
        (c.activation == "quick_geglu" and c.glu_linear_offset == 1.0
         and c.activation_func_clamp_value is not None,
         "the MLP must be quick GeGLU with offset 1 and a clamp"),
        (c.softmax_type == "learnable", "attention needs learned sinks (softmax_type learnable)"),
        (c.add_bias_linear, "gpt-oss has biases on q/k/v/o, the router and the experts"),
        (c.moe_ffn_hidden_size == c.ffn_hidden_size, "one intermediate size"),
        (c.moe_router_score_function == "softmax" and not c.moe_router_pre_softmax
         and c.moe_router_topk_scaling_factor is None and c.moe_router_num_groups is None,
         "the router takes the softmax of the top-k logits"),
        (window is None or (window[1] == 0 and window[0] >= 0), "windows must be causal"),
        (c.rope_type == "rope" or (c.mscale == 1.0 and c.mscale_all_dim == 0.0),
         "YaRN with mscale 1 and mscale_all_dim 0"),
    ]
    for ok, message in checks:
        require(ok, f"cannot export to {FAMILY}: {message}")
    shared = _shared(c)
    sliding = [is_window_layer(c, i) for i in range(c.num_layers)]
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": c.rotary_base,
                "truncate": c.yarn_correction_range_round_to_int,
                **{key: getattr(c, name) for key, name in _YARN.items()}}
    return {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **shared,
            "rope_parameters": rope, "intermediate_size": c.moe_ffn_hidden_size,
            "num_local_experts": c.num_moe_experts, "num_experts_per_tok": c.moe_router_topk,
            "router_aux_loss_coef": c.moe_aux_loss_coeff, "attention_bias": True,
            "swiglu_alpha": QUICK_GELU_ALPHA, "swiglu_limit": c.activation_func_clamp_value,
            "sliding_window": None if window is None else window[0] + 1,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
            "output_router_logits": False}


def _shared(c: TransformerConfig) -> Dict[str, Any]:
    checks = [(c.position_embedding_type == "rope", "position_embedding_type must be rope"),
              (c.normalization == "RMSNorm", "normalization must be RMSNorm"),
              (c.rotary_percent == 1.0 and c.rotary_seq_len_interpolation_factor is None
               and not c.rope_scaling, "RoPE must rotate whole heads without other scaling"),
              (not c.layernorm_zero_centered_gamma, "plain norm weights")]
    for ok, message in checks:
        require(ok, f"cannot export to {FAMILY}: {message}")
    return {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_query_groups, "head_dim": c.kv_channels,
            "max_position_embeddings": c.max_position_embeddings,
            "rms_norm_eps": c.layernorm_epsilon, "attention_dropout": c.attention_dropout,
            "initializer_range": c.init_method_std,
            "tie_word_embeddings": not c.untie_embeddings_and_output_weights}


def _layer_from_hf(src: StateDict, i: int, config: TransformerConfig) -> StateDict:
    """Layer i's sinks and MoE block (the rest is Llama's)."""
    ours, theirs = layer_prefix(i), f"model.layers.{i}."
    require(f"{theirs}mlp.experts.gate_up_proj_blocks" not in src, MXFP4)
    gate_up = src.pop(theirs + "mlp.experts.gate_up_proj")
    gate_up_bias = src.pop(theirs + "mlp.experts.gate_up_proj_bias")
    return {
        ours + "self_attention.core_attention.softmax_offset": src.pop(theirs + "self_attn.sinks"),
        ours + "mlp.router.weight": src.pop(theirs + "mlp.router.weight"),
        ours + "mlp.router.bias": src.pop(theirs + "mlp.router.bias"),
        ours + "mlp.experts.weight1": torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], -1),
        ours + "mlp.experts.bias1": torch.cat([gate_up_bias[..., ::2], gate_up_bias[..., 1::2]],
                                              -1),
        ours + "mlp.experts.weight2": src.pop(theirs + "mlp.experts.down_proj"),
        ours + "mlp.experts.bias2": src.pop(theirs + "mlp.experts.down_proj_bias"),
    }


def _interleave(stacked: torch.Tensor) -> torch.Tensor:
    """[..., 2f] as [gate, linear] -> gate and linear columns interleaved."""
    gate, linear = stacked.chunk(2, dim=-1)
    return torch.stack([gate, linear], dim=-1).flatten(-2)


def _layer_to_hf(state: StateDict, i: int, config: TransformerConfig) -> StateDict:
    ours, theirs = layer_prefix(i), f"model.layers.{i}."
    return {
        theirs + "self_attn.sinks": state[ours + "self_attention.core_attention.softmax_offset"],
        theirs + "mlp.router.weight": state[ours + "mlp.router.weight"],
        theirs + "mlp.router.bias": state[ours + "mlp.router.bias"],
        theirs + "mlp.experts.gate_up_proj": _interleave(state[ours + "mlp.experts.weight1"]),
        theirs + "mlp.experts.gate_up_proj_bias": _interleave(state[ours + "mlp.experts.bias1"]),
        theirs + "mlp.experts.down_proj": state[ours + "mlp.experts.weight2"],
        theirs + "mlp.experts.down_proj_bias": state[ours + "mlp.experts.bias2"],
    }


def state_dict_from_hf(hf_state: StateDict, config: TransformerConfig) -> StateDict:
    """gigatron GPTModel state dict (tp=1) from GptOssForCausalLM tensors."""
    return hf_llama.state_dict_from_hf(hf_state, config, _layer_from_hf, FAMILY)


def state_dict_to_hf(state: StateDict, config: TransformerConfig) -> StateDict:
    """GptOssForCausalLM tensors (save_pretrained's names) from a gigatron state dict."""
    return hf_llama.state_dict_to_hf(state, config, _layer_to_hf)
