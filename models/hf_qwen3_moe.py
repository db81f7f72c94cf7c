"""Qwen3-MoE (`Qwen3MoeForCausalLM`) <-> gigatron: config fields and tensors, at tp=1 / pp=1.

Qwen3's attention (models/hf_qwen3.py: q_norm / k_norm as --qk-layernorm) with MoE MLPs:

- the router `mlp.gate.weight` [E, h] is gigatron's `mlp.router.weight` (both bias-free);
- transformers' router takes the softmax over all experts and keeps the top-k; with
  `norm_topk_prob` true it renormalises them to sum to 1, which is the softmax of the top-k
  logits: Megatron-Core's softmax *after* top-k (`moe_router_pre_softmax=False`, as Mixtral).
  With `norm_topk_prob` false (transformers' default; the published models set true) it
  keeps the top-k of the full softmax unnormalised: Megatron-Core's
  `moe_router_pre_softmax=True`.
- expert e's SwiGLU: `experts.{e}.gate_proj`, `up_proj` [f, h] and `down_proj` [h, f] on
  disk (what save_pretrained writes; transformers 5 holds them fused in memory as
  `experts.gate_up_proj` [E, 2f, h] ([gate; up]) and `down_proj` [E, h, f]). Both are read;
  exports are written in the on-disk form. gigatron stacks them as `experts.weight1`
  [E, h, 2f] ([gate, up] along the last dim) and `weight2` [E, f, h].
- which layers are MoE: transformers' rule (layer i unless i is in `mlp_only_layers`, and
  only if (i + 1) % `decoder_sparse_step` == 0) as a 0/1 per layer in moe_layer_freq
  (Megatron's integer N puts MoE on layers 0, N, 2N...: another set). Dense layers are
  SwiGLU MLPs of `intermediate_size` (ffn_hidden_size); experts are `moe_intermediate_size`.

`router_aux_loss_coef` maps to `--moe-aux-loss-coeff` (transformers adds that loss only with
output_router_logits=true). Training-only settings with no Qwen3-MoE key (z-loss, the
router's dtype, grouped GEMM, the dispatcher) are not written on export.
"""
from __future__ import annotations

from typing import Any, Dict, List, Union

from gigatron.models import hf_llama, hf_qwen3
from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, require
from gigatron.models.hf_mixtral import moe_block_checks, moe_from_hf, moe_to_hf
from gigatron.models.moe.config_checks import moe_layer_pattern

FAMILY = "Qwen3-MoE"
# Qwen3MoeConfig's defaults for the keys a config.json may leave out
DEFAULTS = {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "norm_topk_prob": False, "router_aux_loss_coef": 0.001, "decoder_sparse_step": 1}


def _get(hf: Dict[str, Any], key: str) -> Any:
    value = hf.get(key)
    return DEFAULTS[key] if value is None else value


def moe_layer_freq(hf: Dict[str, Any]) -> Union[int, List[int]]:
    """moe_layer_freq of transformers' layer rule: 1 when every layer is MoE, else a 0/1 list."""
    step, dense = _get(hf, "decoder_sparse_step"), set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0)
               for i in range(hf["num_hidden_layers"])]
    require(any(pattern), f"{FAMILY} decoder_sparse_step={step} with mlp_only_layers="
            f"{sorted(dense)} leaves no MoE layer: convert it as a dense model")
    return 1 if all(pattern) else pattern


def config_from_hf(hf: Dict[str, Any]) -> TransformerConfig:
    """TransformerConfig of a Qwen3-MoE config.json: Qwen3's fields plus the MoE ones."""
    # transformers 5 saves num_experts as num_local_experts (its attribute map)
    experts = hf.get("num_local_experts") or _get(hf, "num_experts")
    topk, renormalise = _get(hf, "num_experts_per_tok"), bool(_get(hf, "norm_topk_prob"))
    require(topk >= 2 or not renormalise, f"{FAMILY} num_experts_per_tok={topk} with "
            f"norm_topk_prob=true is not supported: every weight is 1, Megatron's "
            f"softmax-after-top-k with top-1 (refused: its gradient is zero)")
    jitter = hf.get("router_jitter_noise", 0.0)
    require(not jitter, f"{FAMILY} router_jitter_noise={jitter} is not supported: gigatron's "
            f"router has no input jitter (set it to 0)")
    fields = hf_qwen3.config_fields(hf, FAMILY)
    fields.update(
        num_moe_experts=experts, moe_ffn_hidden_size=_get(hf, "moe_intermediate_size"),
        moe_layer_freq=moe_layer_freq(hf), moe_router_topk=topk,
        moe_router_score_function="softmax", moe_router_pre_softmax=not renormalise,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(_get(hf, "router_aux_loss_coef")))
    return TransformerConfig(**fields)


def config_to_hf(config: TransformerConfig) -> Dict[str, Any]:
    """Qwen3-MoE config.json of a TransformerConfig; raises on what it cannot express."""
    moe = config.num_moe_experts is not None
    checks = [(moe, "the model is dense (num_moe_experts is None): export it as qwen3"),
              (config.moe_router_score_function == "softmax",
               "the router's scores must be a softmax (no sigmoid)"),
              *moe_block_checks(config, FAMILY)]
    for ok, message in checks:
        require(ok, f"cannot export to {FAMILY}: {message}")
    balancing = config.moe_router_load_balancing_type != "none"
    pattern = moe_layer_pattern(config)
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            **hf_qwen3.shared_config_to_hf(config, FAMILY),
            "intermediate_size": config.ffn_hidden_size,
            "moe_intermediate_size": config.moe_ffn_hidden_size,
            "num_experts": config.num_moe_experts, "num_experts_per_tok": config.moe_router_topk,
            "norm_topk_prob": not config.moe_router_pre_softmax,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, is_moe in enumerate(pattern) if not is_moe],
            "router_aux_loss_coef": config.moe_aux_loss_coeff if balancing else 0.0,
            "output_router_logits": False}


_NAMES = ("gate_proj", "up_proj", "down_proj")


def _moe_from_hf(src: StateDict, i: int, config: TransformerConfig) -> StateDict:
    return moe_from_hf(src, i, config, f"model.layers.{i}.mlp.", _NAMES, FAMILY)


def _moe_to_hf(state: StateDict, i: int) -> StateDict:
    return moe_to_hf(state, i, f"model.layers.{i}.mlp.", _NAMES)


def _layer_from_hf(src: StateDict, i: int, config: TransformerConfig) -> StateDict:
    mlp = (_moe_from_hf if moe_layer_pattern(config)[i] else hf_llama.dense_mlp_from_hf)
    return {**hf_qwen3.qk_norms_from_hf(src, i, FAMILY), **mlp(src, i, config)}


def _layer_to_hf(state: StateDict, i: int, config: TransformerConfig) -> StateDict:
    mlp = (_moe_to_hf(state, i) if moe_layer_pattern(config)[i]
           else hf_llama.dense_mlp_to_hf(state, i, config))
    return {**hf_qwen3.qk_norms_to_hf(state, i), **mlp}


def state_dict_from_hf(hf_state: StateDict, config: TransformerConfig) -> StateDict:
    """gigatron GPTModel state dict (tp=1) from Qwen3MoeForCausalLM tensors."""
    return hf_llama.state_dict_from_hf(hf_state, config, _layer_from_hf, FAMILY)


def state_dict_to_hf(state: StateDict, config: TransformerConfig) -> StateDict:
    """Qwen3MoeForCausalLM tensors (save_pretrained's names) from a gigatron state dict."""
    return hf_llama.state_dict_to_hf(state, config, _layer_to_hf)
