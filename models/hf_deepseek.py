"""DeepSeek-V3 (`DeepseekV3ForCausalLM`: DeepSeek-V3/R1, Kimi K2, Moonlight) and DeepSeek-V2
(`DeepseekV2ForCausalLM`, family `V2` below) <-> gigatron: config fields and tensors, at
tp=1 / pp=1.

- attention is multi-latent attention (models/mla/): `q_a_proj` / `q_a_layernorm` /
  `q_b_proj` (or `q_proj` without query compression), `kv_a_proj_with_mqa` /
  `kv_a_layernorm` / `kv_b_proj` and `o_proj` are Megatron-Core's linear_q_down_proj /
  q_layernorm / linear_q_up_proj (linear_q_proj), linear_kv_down_proj / kv_layernorm /
  linear_kv_up_proj and linear_proj, one to one (same row order: transformers'
  `rope_interleave` layout is Megatron-Core's MLA RoPE layout); the latent norms are
  --qk-layernorm. transformers gives them epsilon 1e-6 whatever `rms_norm_eps` says
  (Moonlight's 1e-5 is the other norms'): `rms_norm_eps` is --norm-epsilon, and the latent
  norms' 1e-6 is --mla-latent-norm-epsilon where the two differ.
- RoPE: `rope_parameters` default (--rope-type rope) or yarn (--rope-type yarn with factor,
  original_max_position_embeddings, beta_fast/slow, mscale, mscale_all_dim, truncate).
- the first `first_k_dense_replace` layers are dense SwiGLU MLPs (`intermediate_size`), the
  others MoE: a 0/1 --moe-layer-freq list. The router `mlp.gate.weight` and its
  `e_score_correction_bias` are gigatron's router weight and expert bias (sigmoid scores,
  fp32 routing, --moe-router-enable-expert-bias), `n_group` / `topk_group` the
  group-limited routing, `routed_scaling_factor` --moe-router-topk-scaling-factor; the
  `n_shared_experts` shared experts are one shared MLP of n x `moe_intermediate_size`.
  transformers ranks a group by its best 2 scores, Megatron by its best topk / topk_group:
  configs where these differ (and more than one group may be left out) are refused.
- multi-token prediction weights (`num_nextn_predict_layers` layers after the last) are
  read and written when the gigatron config has --mtp-num-layers (depth d is HF's layer
  `num_layers + d`: its decoder layer converts as one more decoder layer of the last layer's
  kind; `enorm`, `hnorm`, `eh_proj` and `shared_head.norm` are MultiTokenPredictionLayer's
  enorm, hnorm, eh_proj and final_layernorm; `shared_head.head` and `embed_tokens`, copies
  of the model's output layer and embedding that gigatron's MTP shares, are not read, and
  exports write them as those copies); without it they are not read, as transformers does
  not read them, and exports write none.
- DeepSeek-V2 has the same tensors but for the correction bias, and routes greedily: top-k
  of a softmax over all experts, not renormalised, times `routed_scaling_factor`, which is
  Megatron's --moe-router-pre-softmax with the scaling factor; its `group_limited_greedy`
  ranks groups by their best expert (not Megatron's rule) and is refused where it limits.
  `aux_loss_alpha` with `seq_aux` is --moe-aux-loss-coeff of seq_aux_loss (aux_loss without).
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any, Dict

import torch

from gigatron.models import hf_llama
from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, layer_prefix, pad_vocab, require, unpad_vocab
from gigatron.models.hf_mixtral import moe_from_hf, moe_to_hf, take
from gigatron.models.moe.config_checks import moe_layer_pattern

FAMILY = "DeepSeek-V3"
LATENT_NORM_EPS = 1e-6  # transformers' DeepseekV3RMSNorm default, used for q_a/kv_a norms
_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
_YARN_KEYS = {"factor": "rotary_scaling_factor",
              "original_max_position_embeddings": "original_max_position_embeddings",
              "beta_fast": "beta_fast", "beta_slow": "beta_slow", "mscale": "mscale",
              "mscale_all_dim": "mscale_all_dim"}


def _rope_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    fields: Dict[str, Any] = {"rotary_base": float(theta)}
    if kind == "default":
        return dict(fields, rope_type="rope")
    require(kind == "yarn", f"{FAMILY} rope_type {kind!r} is not supported (default, yarn)")
    require(params.get("attention_factor") is None, f"{FAMILY} yarn attention_factor is not "
            f"supported: gigatron derives it from factor, mscale and mscale_all_dim")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    require(not mscale_all_dim or mscale, f"{FAMILY} yarn mscale_all_dim without mscale is "
            f"not supported")
    if not (mscale and mscale_all_dim):  # transformers' concentration: mscale(factor)
        params.update(mscale=1.0, mscale_all_dim=0.0)
    if params.get("factor") is None:
        params["factor"] = hf["max_position_embeddings"] / \
            params["original_max_position_embeddings"]
    fields.update(rope_type="yarn",
                  yarn_correction_range_round_to_int=bool(params.get("truncate", True)))
    for key, name in _YARN_KEYS.items():
        if params.get(key) is not None:
            cast = int if key == "original_max_position_embeddings" else float
            fields[name] = cast(params[key])
    return fields


def _v2_routing_fields(hf: Dict[str, Any]) -> Dict[str, Any]:
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    method = hf.get("topk_method") or "greedy"
    require(method == "greedy" or groups in (1, group_topk), f"DeepSeek-V2 topk_method="
            f"{method!r} with n_group={groups} and topk_group={group_topk} is not supported: "
            f"it ranks groups by their best expert, Megatron by their best topk/topk_group")
    require(method in ("greedy", "group_limited_greedy"), f"DeepSeek-V2 topk_method "
            f"{method!r} is not supported (greedy, group_limited_greedy)")
    alpha = float(hf.get("aux_loss_alpha") or 0.0)
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=True,
                moe_router_enable_expert_bias=False, moe_router_num_groups=None,
                moe_router_group_topk=None, moe_aux_loss_coeff=alpha,
                moe_router_load_balancing_type=("seq_aux_loss" if hf.get("seq_aux") else
                                                "aux_loss") if alpha else "none")


def _routing_fields(hf: Dict[str, Any], version: int = 3) -> Dict[str, Any]:
    experts, topk = hf.get("n_routed_experts") or hf["num_local_experts"], \
        hf["num_experts_per_tok"]
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    shared = dict(num_moe_experts=experts, moe_router_topk=topk,
                  moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                  moe_router_dtype="fp32", moe_ffn_hidden_size=hf["moe_intermediate_size"],
                  moe_shared_expert_intermediate_size=(
                      hf["moe_intermediate_size"] * hf["n_shared_experts"]
                      if hf.get("n_shared_experts") else None))
    if version == 2:
        return dict(shared, **_v2_routing_fields(hf))
    require(hf.get("norm_topk_prob", True) or topk == 1, f"{FAMILY} norm_topk_prob=false is "
            f"not supported: Megatron normalises sigmoid top-k weights")
    require(groups in (1, group_topk) or topk // group_topk == 2, f"{FAMILY} n_group={groups}"
            f" with topk_group={group_topk} and num_experts_per_tok={topk} is not supported: "
            f"transformers ranks groups by their best 2 experts, Megatron by their best "
            f"{topk // group_topk}")
    grouped = groups > 1 and group_topk < groups
    return dict(shared, moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_num_groups=groups if grouped else None,
                moe_router_group_topk=group_topk if grouped else None,
                moe_router_load_balancing_type="none")


def config_from_hf(hf: Dict[str, Any], version: int = 3) -> TransformerConfig:
    """TransformerConfig of a DeepSeek-V3 (`version` 2: V2) config.json."""
    require(hf.get("hidden_act", "silu") == "silu", f"{FAMILY} hidden_act must be silu")
    require(not hf.get("attention_bias", False), f"{FAMILY} attention_bias=true is not "
            f"supported: gigatron's MLA projections have no biases")
    require(hf.get("rope_interleave", True), f"{FAMILY} rope_interleave=false is not "
            f"supported (Megatron-Core's MLA reads RoPE channels interleaved)")
    eps = float(hf.get("rms_norm_eps", 1e-6))
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    dense = min(hf.get("first_k_dense_replace") or 0, layers)
    require(dense < layers, f"{FAMILY} first_k_dense_replace={dense} leaves no MoE layer")
    fields: Dict[str, Any] = dict(
        num_layers=layers, hidden_size=hf["hidden_size"], num_attention_heads=heads,
        vocab_size=hf["vocab_size"], seq_length=hf["max_position_embeddings"],
        max_position_embeddings=hf["max_position_embeddings"],
        ffn_hidden_size=hf["intermediate_size"], activation="swiglu", normalization="RMSNorm",
        layernorm_epsilon=eps, position_embedding_type="rope", add_bias_linear=False,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02), apply_scaled_init=False,
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"], qk_head_dim=hf["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        qk_layernorm=True, mla_latent_norm_epsilon=None if eps == LATENT_NORM_EPS
        else LATENT_NORM_EPS, moe_layer_freq=[0] * dense + [1] * (layers - dense),
        **_rope_fields(hf), **_routing_fields(hf, version))
    return TransformerConfig(**fields)


def _first_dense(config: TransformerConfig) -> int:
    pattern = moe_layer_pattern(config)
    dense = pattern.index(True) if True in pattern else len(pattern)
    require(all(pattern[dense:]), f"cannot export to {FAMILY}: MoE layers must follow the "
            f"dense ones (first_k_dense_replace), got moe_layer_freq {config.moe_layer_freq}")
    return dense


def config_to_hf(config: TransformerConfig, version: int = 3) -> Dict[str, Any]:
    """DeepSeek-V3 (`version` 2: V2) config.json of a TransformerConfig; raises on what it
    cannot express."""
    c = config
    shared = c.moe_shared_expert_intermediate_size
    family = FAMILY if version == 3 else "DeepSeek-V2"
    routing = (c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias,
               "the router must score by sigmoid with the expert bias (DeepSeek-V2: softmax)")
    if version == 2:
        routing = (c.moe_router_score_function == "softmax" and c.moe_router_pre_softmax
                   and c.moe_router_num_groups is None,
                   "the router must take the top-k of a softmax over all experts "
                   "(--moe-router-pre-softmax), without groups (DeepSeek-V3: sigmoid)")
    checks = [routing, 
        (c.multi_latent_attention and c.qk_layernorm, "the model needs multi-latent "
         "attention with its latent norms (--multi-latent-attention --qk-layernorm)"),
        (c.num_moe_experts is not None, "the model is dense (num_moe_experts is None)"),
        (c.normalization == "RMSNorm" and c.activation == "swiglu" and not c.add_bias_linear,
         "RMSNorm, SwiGLU and no biases are DeepSeek-V3's"),
        ((c.mla_latent_norm_epsilon or c.layernorm_epsilon) == LATENT_NORM_EPS,
         f"the latent norms' epsilon must be {LATENT_NORM_EPS}, transformers' (got "
         f"{c.mla_latent_norm_epsilon or c.layernorm_epsilon}: --mla-latent-norm-epsilon, "
         f"else --norm-epsilon)"),
        (shared is None or shared % c.moe_ffn_hidden_size == 0, "the shared experts' width "
         "must be a multiple of moe_ffn_hidden_size"),
        (c.rotary_percent == 1.0 and c.moe_expert_capacity_factor is None
         and not c.layernorm_zero_centered_gamma, "rotary_percent 1, dropless routing and "
         "plain norm weights are DeepSeek-V3's"),
    ]
    for ok, message in checks:
        require(ok, f"cannot export to {family}: {message}")
    rope: Dict[str, Any] = {"rope_type": "default", "rope_theta": c.rotary_base}
    if c.rope_type == "yarn":
        rope = {"rope_type": "yarn", "rope_theta": c.rotary_base,
                "truncate": c.yarn_correction_range_round_to_int,
                **{key: getattr(c, name) for key, name in _YARN_KEYS.items()}}
    groups = c.moe_router_num_groups or 1
    out = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size, "moe_intermediate_size": c.moe_ffn_hidden_size,
        "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_attention_heads,
        "n_shared_experts": (shared or 0) // c.moe_ffn_hidden_size,
        "n_routed_experts": c.num_moe_experts,
        "routed_scaling_factor": c.moe_router_topk_scaling_factor or 1.0,
        "kv_lora_rank": c.kv_lora_rank, "q_lora_rank": c.q_lora_rank,
        "qk_rope_head_dim": c.qk_pos_emb_head_dim, "v_head_dim": c.v_head_dim,
        "qk_nope_head_dim": c.qk_head_dim, "n_group": groups,
        "topk_group": c.moe_router_group_topk or groups,
        "num_experts_per_tok": c.moe_router_topk, "first_k_dense_replace": _first_dense(c),
        "norm_topk_prob": True, "hidden_act": "silu",
        "max_position_embeddings": c.max_position_embeddings,
        "initializer_range": c.init_method_std, "rms_norm_eps": c.layernorm_epsilon,
        "tie_word_embeddings": not c.untie_embeddings_and_output_weights,
        "rope_parameters": rope, "rope_interleave": True, "attention_bias": False,
        "attention_dropout": c.attention_dropout,
        "num_nextn_predict_layers": c.mtp_num_layers or 0}
    if version == 2:
        balancing = c.moe_router_load_balancing_type
        out.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                   topk_method="greedy", norm_topk_prob=False,
                   aux_loss_alpha=c.moe_aux_loss_coeff if balancing != "none" else 0.0,
                   seq_aux=balancing == "seq_aux_loss")
        for key in ("rope_interleave", "num_nextn_predict_layers"):
            del out[key]
    return out


def _attention_names(config: TransformerConfig) -> Dict[str, str]:
    """gigatron name in a layer -> transformers' name in a layer, attention and norms."""
    names = {"input_layernorm.weight": "input_layernorm.weight",
             "pre_mlp_layernorm.weight": "post_attention_layernorm.weight"}
    ours = {"linear_kv_down_proj": "kv_a_proj_with_mqa", "kv_layernorm": "kv_a_layernorm",
            "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}
    if config.q_lora_rank is None:
        ours["linear_q_proj"] = "q_proj"
    else:
        ours.update(linear_q_down_proj="q_a_proj", q_layernorm="q_a_layernorm",
                    linear_q_up_proj="q_b_proj")
    names.update({f"self_attention.{a}.weight": f"self_attn.{b}.weight"
                  for a, b in ours.items()})
    return names


def state_dict_from_hf(hf_state: StateDict, config: TransformerConfig) -> StateDict:
    """gigatron GPTModel state dict (tp=1) from DeepseekV3ForCausalLM tensors."""
    src = dict(hf_state)
    out: StateDict = {
        "embedding.word_embeddings.weight": pad_vocab(take(src, "model.embed_tokens.weight",
                                                           FAMILY), config),
        "decoder.final_layernorm.weight": take(src, "model.norm.weight", FAMILY)}
    if config.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad_vocab(take(src, "lm_head.weight", FAMILY), config)
    else:
        src.pop("lm_head.weight", None)
    pattern = moe_layer_pattern(config)
    for i in range(config.num_layers):
        out.update(_layer_from_hf(src, i, config, pattern[i]))
    out.update(_mtp_from_hf(src, config))
    mtp = [k for k in src if _layer_number(k) >= config.num_layers]  # MTP not asked for
    leftover = [k for k in src if k not in mtp and not k.endswith("rotary_emb.inv_freq")]
    require(not leftover, f"{FAMILY} tensors not understood: {', '.join(sorted(leftover))}")
    return {k: v.contiguous() for k, v in out.items()}


def _layer_from_hf(src: StateDict, i: int, config: TransformerConfig, moe: bool
                   ) -> StateDict:
    """Decoder layer i's tensors (taken out of `src`) by gigatron's names."""
    out: StateDict = {}
    ours, theirs = layer_prefix(i), f"model.layers.{i}."
    for name, hf_name in _attention_names(config).items():
        out[ours + name] = take(src, theirs + hf_name, FAMILY)
    if not moe:
        out.update(hf_llama.dense_mlp_from_hf(src, i, config))
        return out
    if config.moe_router_enable_expert_bias:  # fp32, as transformers and gigatron keep it
        out[ours + "mlp.router.expert_bias"] = take(
            src, theirs + "mlp.gate.e_score_correction_bias", FAMILY).float()
    if config.moe_shared_expert_intermediate_size is not None:
        gate, up, down = (take(src, f"{theirs}mlp.shared_experts.{p}_proj.weight", FAMILY)
                          for p in ("gate", "up", "down"))
        out[ours + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([gate, up])
        out[ours + "mlp.shared_experts.linear_fc2.weight"] = down
    out.update(moe_from_hf(src, i, config, theirs + "mlp.", _EXPERT_NAMES, FAMILY))
    return out


# MultiTokenPredictionLayer's own tensors <-> those of HF's MTP layer
_MTP_NAMES = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
              "eh_proj.weight": "eh_proj.weight",
              "final_layernorm.weight": "shared_head.norm.weight"}


def _mtp_from_hf(src: StateDict, config: TransformerConfig) -> StateDict:
    """The --mtp-num-layers depths from HF's layers num_layers, num_layers + 1, ..."""
    from gigatron.models.mtp.block import mtp_layer_config  # mtp/ builds on the transformer

    out: StateDict = {}
    depth, extended = config.mtp_num_layers or 0, mtp_layer_config(config)
    pattern = moe_layer_pattern(extended)
    for d in range(depth):
        n, ours = config.num_layers + d, f"mtp.layers.{d}."
        theirs = f"model.layers.{n}."
        layer = _layer_from_hf(src, n, extended, pattern[n])
        out.update({ours + "transformer_layer." + k[len(layer_prefix(n)):]: v
                    for k, v in layer.items()})
        for name, hf_name in _MTP_NAMES.items():
            out[ours + name] = take(src, theirs + hf_name, FAMILY)
        for copy in ("shared_head.head.weight", "embed_tokens.weight"):
            src.pop(theirs + copy, None)  # the model's own output layer and embedding
    return out


def _mtp_to_hf(state: StateDict, config: TransformerConfig, lm_head: torch.Tensor,
               embedding: torch.Tensor) -> StateDict:
    """HF's MTP layers num_layers, ... from the --mtp-num-layers depths."""
    from gigatron.models.mtp.block import mtp_layer_config

    out: StateDict = {}
    depth, extended = config.mtp_num_layers or 0, mtp_layer_config(config)
    pattern = moe_layer_pattern(extended)
    for d in range(depth):
        n, ours = config.num_layers + d, f"mtp.layers.{d}."
        theirs = f"model.layers.{n}."
        layer = {layer_prefix(n) + k[len(ours + "transformer_layer."):]: v
                 for k, v in state.items() if k.startswith(ours + "transformer_layer.")}
        out.update(_layer_to_hf(layer, n, extended, pattern[n]))
        for name, hf_name in _MTP_NAMES.items():
            out[theirs + hf_name] = state[ours + name]
        out[theirs + "shared_head.head.weight"] = lm_head
        out[theirs + "embed_tokens.weight"] = embedding
    return out


def _layer_number(name: str) -> int:
    parts = name.split(".")
    return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1


def state_dict_to_hf(state: StateDict, config: TransformerConfig) -> StateDict:
    """DeepseekV3ForCausalLM tensors (save_pretrained's names) from a gigatron state dict."""
    out: StateDict = {
        "model.embed_tokens.weight": unpad_vocab(state["embedding.word_embeddings.weight"],
                                                 config),
        "model.norm.weight": state["decoder.final_layernorm.weight"]}
    if config.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = unpad_vocab(state["output_layer.weight"], config)
    pattern = moe_layer_pattern(config)
    for i in range(config.num_layers):
        out.update(_layer_to_hf(state, i, config, pattern[i]))
    head = out.get("lm_head.weight", out["model.embed_tokens.weight"])
    out.update(_mtp_to_hf(state, config, head, out["model.embed_tokens.weight"]))
    return {k: v.contiguous() for k, v in out.items()}



def _layer_to_hf(state: StateDict, i: int, config: TransformerConfig, moe: bool) -> StateDict:
    """Decoder layer i's tensors by transformers' names."""
    out: StateDict = {}
    ours, theirs = layer_prefix(i), f"model.layers.{i}."
    for name, hf_name in _attention_names(config).items():
        out[theirs + hf_name] = state[ours + name]
    if not moe:
        out.update(hf_llama.dense_mlp_to_hf(state, i, config))
        return out
    if config.moe_router_enable_expert_bias:
        out[theirs + "mlp.gate.e_score_correction_bias"] = state[ours + "mlp.router.expert_bias"]
    if config.moe_shared_expert_intermediate_size is not None:
        gate, up = state[ours + "mlp.shared_experts.linear_fc1.weight"].chunk(2)
        out[theirs + "mlp.shared_experts.gate_proj.weight"] = gate
        out[theirs + "mlp.shared_experts.up_proj.weight"] = up
        out[theirs + "mlp.shared_experts.down_proj.weight"] = \
            state[ours + "mlp.shared_experts.linear_fc2.weight"]
    out.update(moe_to_hf(state, i, theirs + "mlp.", _EXPERT_NAMES))
    return out


# DeepSeek-V2 as a converter family (models/hf_convert.FAMILIES["deepseek_v2"])
V2 = SimpleNamespace(config_from_hf=partial(config_from_hf, version=2),
                     config_to_hf=partial(config_to_hf, version=2),
                     state_dict_from_hf=state_dict_from_hf, state_dict_to_hf=state_dict_to_hf)
