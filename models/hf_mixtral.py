"""Mixtral (`MixtralForCausalLM`) <-> gigatron: config fields and tensors, at tp=1 / pp=1.

Mixtral is Llama with every MLP replaced by a mixture of experts, so attention, norms and
embeddings go through models/hf_llama.py and only the MoE block is mapped here:

- the router `gate.weight` [E, h] is gigatron's `mlp.router.weight` (both bias-free);
- Mixtral's router takes the softmax over all experts, keeps the top-k and renormalises them
  to sum to 1. Softmax is monotonic, so the top-k of the probabilities are the top-k of the
  logits, and the renormalised top-k probabilities are the softmax of the top-k logits:
  Megatron-Core's default routing (score function softmax *after* top-k,
  `moe_router_pre_softmax=False`). pre-softmax would keep the unnormalised probabilities.
- expert e's SwiGLU: w1 (gate) and w3 (up) [f, h], w2 (down) [h, f] on disk (what
  transformers' `save_pretrained` writes, 4.x and 5.x alike); transformers 5 holds them in
  memory fused as `mlp.experts.gate_up_proj` [E, 2f, h] ([gate; up]) and `down_proj`
  [E, h, f]. Both are read; exports are written in the on-disk form. gigatron stacks them as
  `experts.weight1` [E, h, 2f] ([gate, up] along the last dim) and `weight2` [E, f, h].

Training-only settings with no Mixtral key (z-loss, seq_aux_loss, the router's dtype, grouped
GEMM, the token dispatcher) are not written on export; `router_aux_loss_coef` maps to
`--moe-aux-loss-coeff` (transformers adds that loss only with output_router_logits=true).
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from gigatron.models import hf_llama
from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import StateDict, layer_prefix, require
from gigatron.models.moe.config_checks import moe_layer_pattern

# MixtralConfig's defaults for the keys a config.json may leave out
DEFAULT_EXPERTS, DEFAULT_TOPK, DEFAULT_AUX_LOSS_COEF = 8, 2, 0.001


def config_from_hf(hf: Dict[str, Any]) -> TransformerConfig:
    """TransformerConfig of a Mixtral config.json: Llama's fields plus the MoE ones."""
    topk = hf.get("num_experts_per_tok", DEFAULT_TOPK)
    require(topk >= 2, f"Mixtral num_experts_per_tok={topk} is not supported: gigatron's "
            f"softmax-after-top-k router needs at least 2 (Megatron refuses top-1 without "
            f"--moe-router-pre-softmax, which does not renormalise as Mixtral does)")
    window = hf.get("sliding_window")
    require(window is None or window >= hf["max_position_embeddings"],
            f"Mixtral sliding_window={window} is not supported: gigatron attends to the whole "
            f"sequence (set it to null)")
    jitter = hf.get("router_jitter_noise", 0.0)
    require(not jitter, f"Mixtral router_jitter_noise={jitter} is not supported: gigatron's "
            f"router has no input jitter (set it to 0)")
    fields = hf_llama.config_fields(hf, "Mixtral")
    fields.update(
        num_moe_experts=hf.get("num_local_experts", DEFAULT_EXPERTS),
        moe_ffn_hidden_size=hf["intermediate_size"], moe_router_topk=topk,
        moe_router_score_function="softmax", moe_router_pre_softmax=False,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", DEFAULT_AUX_LOSS_COEF)))
    return TransformerConfig(**fields)


def config_to_hf(config: TransformerConfig) -> Dict[str, Any]:
    """Mixtral config.json of a TransformerConfig; raises on what Mixtral cannot express."""
    moe = config.num_moe_experts is not None
    checks = [
        (moe, "the model is dense (num_moe_experts is None): export it as llama"),
        (not moe or all(moe_layer_pattern(config)),
         "every layer must be an MoE layer (moe_layer_freq 1): Mixtral has no dense layers"),
        (config.moe_router_score_function == "softmax" and not config.moe_router_pre_softmax,
         "the router must take the softmax after top-k (Mixtral renormalises the top-k): no "
         "--moe-router-pre-softmax, no sigmoid scores"),
        *moe_block_checks(config, "Mixtral")]
    for ok, message in checks:
        require(ok, f"cannot export to Mixtral: {message}")
    balancing = config.moe_router_load_balancing_type != "none"
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
            **hf_llama.shared_config_to_hf(config, "Mixtral"),
            "intermediate_size": config.moe_ffn_hidden_size,
            "num_local_experts": config.num_moe_experts,
            "num_experts_per_tok": config.moe_router_topk,
            "router_aux_loss_coef": config.moe_aux_loss_coeff if balancing else 0.0,
            "output_router_logits": False, "router_jitter_noise": 0.0, "sliding_window": None}


def moe_block_checks(config: TransformerConfig, family: str) -> List[Tuple[bool, str]]:
    """(holds, what fails) for the MoE settings a softmax top-k family (Mixtral, Qwen3-MoE)
    has no key for."""
    return [
        (config.moe_router_topk_scaling_factor in (None, 1.0),
         f"moe_router_topk_scaling_factor has no {family} equivalent"),
        (config.moe_router_num_groups is None and config.moe_router_group_topk is None,
         f"group-limited routing (moe_router_num_groups) has no {family} equivalent"),
        (not config.moe_router_enable_expert_bias,
         f"the expert bias (moe_router_enable_expert_bias) has no {family} equivalent"),
        (config.moe_router_load_balancing_type != "sinkhorn",
         f"sinkhorn routing has no {family} equivalent"),
        (config.moe_expert_capacity_factor is None,
         f"token dropping (moe_expert_capacity_factor) has no {family} equivalent: {family} "
         f"is dropless"),
        (config.moe_shared_expert_intermediate_size is None,
         f"shared experts (moe_shared_expert_intermediate_size) have no {family} equivalent"),
        (not config.add_bias_linear, f"{family}'s linears have no biases (add_bias_linear)")]


def take(src: StateDict, name: str, family: str) -> torch.Tensor:
    """Pop one Hugging Face tensor, or one line naming it when it is missing."""
    require(name in src, f"{family} tensor {name} is missing")
    return src.pop(name)


def moe_from_hf(src: StateDict, i: int, config: TransformerConfig, theirs: str,
                names: Tuple[str, str, str], family: str) -> StateDict:
    """Layer i's router (`theirs`gate.weight) and experts, from either the per-expert tensors
    save_pretrained writes (`theirs`experts.{e}.{name}.weight for the gate, up and down
    `names`) or transformers 5's fused `experts.gate_up_proj` / `experts.down_proj`."""
    experts = config.num_moe_experts
    assert experts is not None
    router = take(src, theirs + "gate.weight", family)
    if theirs + "experts.gate_up_proj" in src:
        gate_up = take(src, theirs + "experts.gate_up_proj", family)
        down = take(src, theirs + "experts.down_proj", family)
    else:
        gate, up, down = (torch.stack([take(src, f"{theirs}experts.{e}.{name}.weight", family)
                                       for e in range(experts)]) for name in names)
        gate_up = torch.cat([gate, up], dim=1)
    require(router.shape[0] == experts, f"{family} layer {i} router has {router.shape[0]} "
            f"experts, config has {experts}")
    ours = layer_prefix(i) + "mlp."
    return {ours + "router.weight": router,
            ours + "experts.weight1": gate_up.transpose(1, 2),
            ours + "experts.weight2": down.transpose(1, 2)}


def moe_to_hf(state: StateDict, i: int, theirs: str, names: Tuple[str, str, str]
              ) -> StateDict:
    """Layer i's router and experts as the per-expert tensors save_pretrained writes
    (`theirs`experts.{e}.{name}.weight for the gate, up and down `names`)."""
    ours = layer_prefix(i) + "mlp."
    weight1, weight2 = state[ours + "experts.weight1"], state[ours + "experts.weight2"]
    f = weight2.shape[1]
    out = {theirs + "gate.weight": state[ours + "router.weight"]}
    for e in range(weight1.shape[0]):
        gate, up, down = (f"{theirs}experts.{e}.{name}.weight" for name in names)
        out[gate], out[up], out[down] = weight1[e, :, :f].t(), weight1[e, :, f:].t(), weight2[e].t()
    return out


_NAMES = ("w1", "w3", "w2")  # Mixtral's gate, up, down


def _moe_from_hf(src: StateDict, i: int, config: TransformerConfig) -> StateDict:
    """Mixtral's layer i: `block_sparse_moe.` on disk, `mlp.` in transformers 5's memory."""
    on_disk = f"model.layers.{i}.block_sparse_moe."
    theirs = on_disk if on_disk + "gate.weight" in src else f"model.layers.{i}.mlp."
    return moe_from_hf(src, i, config, theirs, _NAMES, "Mixtral")


def _moe_to_hf(state: StateDict, i: int, config: TransformerConfig) -> StateDict:
    return moe_to_hf(state, i, f"model.layers.{i}.block_sparse_moe.", _NAMES)


def state_dict_from_hf(hf_state: StateDict, config: TransformerConfig) -> StateDict:
    """gigatron GPTModel state dict (tp=1) from MixtralForCausalLM tensors."""
    return hf_llama.state_dict_from_hf(hf_state, config, _moe_from_hf, "Mixtral")


def state_dict_to_hf(state: StateDict, config: TransformerConfig) -> StateDict:
    """MixtralForCausalLM tensors (save_pretrained's names) from a gigatron state dict."""
    return hf_llama.state_dict_to_hf(state, config, _moe_to_hf)
