"""Megatron-LM's multi-latent attention and YaRN flags (issue 39) -> TransformerConfig.

Each flag keeps Megatron-LM's name, meaning and default and sets the Megatron-Core
MLATransformerConfig field of that meaning (--yarn-beta-fast: `beta_fast`); a flag left out
is None here so a --model zoo config shows through. One is gigatron's own:
--mla-latent-norm-epsilon (Megatron-Core's latent norms take --norm-epsilon; Hugging Face's
DeepSeek models keep 1e-6 for them whatever their other norms use). Megatron-LM's
defaults, held by the TransformerConfig: --kv-lora-rank 32, --qk-head-dim 128,
--qk-pos-emb-head-dim 64, --v-head-dim 128, --rotary-scaling-factor 1, --mscale 1,
--mscale-all-dim 0; --rope-type unset takes MLATransformerConfig's yarn with MLA. The
model's own rules (ranks against tp, even RoPE channels) are `TransformerConfig.problems`;
this module adds the flag-level ones.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Dict, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems


@dataclass(frozen=True)
class MLASettings:
    """Multi-latent attention (DeepSeek-V2/V3) and YaRN RoPE (None: the --model zoo's value,
    else Megatron-LM's default, named in each doc)."""

    multi_latent_attention: Optional[bool] = setting(
        None, "multi-latent attention (DeepSeek-V2/V3): queries and keys/values through "
        "low-rank latents, a shared rotated key part", "--multi-latent-attention")
    q_lora_rank: Optional[int] = setting(
        None, "rank of the compressed query (default: none, queries projected directly)",
        "--q-lora-rank")
    kv_lora_rank: Optional[int] = setting(
        None, "rank of the compressed key/value latent (default 32)", "--kv-lora-rank")
    qk_head_dim: Optional[int] = setting(
        None, "query/key channels per head without position (default 128)", "--qk-head-dim")
    qk_pos_emb_head_dim: Optional[int] = setting(
        None, "query/key channels per head that RoPE rotates, the key's shared by the heads "
        "(default 64)", "--qk-pos-emb-head-dim")
    v_head_dim: Optional[int] = setting(
        None, "value channels per head (default 128)", "--v-head-dim")
    mla_latent_norm_epsilon: Optional[float] = setting(
        None, "gigatron's: epsilon of the latent norms of --qk-layernorm (default: "
        "--norm-epsilon, as Megatron-Core has them; Hugging Face's DeepSeek-V2/V3 models use "
        "1e-6 whatever their rms_norm_eps, e.g. Moonlight's 1e-5)", "--mla-latent-norm-epsilon")
    rope_type: Optional[str] = setting(
        None, "RoPE of multi-latent attention: rope or yarn (default yarn, Megatron-Core's "
        "MLA default; other attention takes rope only)", "--rope-type",
        choices=("rope", "yarn"))
    rotary_scaling_factor: Optional[float] = setting(
        None, "YaRN's context-extension factor; MLA's softmax scale takes its mscale-all-dim "
        "term (default 1.0)", "--rotary-scaling-factor")
    mscale: Optional[float] = setting(
        None, "YaRN's cos/sin concentration numerator (default 1.0)", "--mscale")
    mscale_all_dim: Optional[float] = setting(
        None, "YaRN's concentration denominator and MLA's softmax-scale term (default 0.0)",
        "--mscale-all-dim")
    yarn_original_max_position_embeddings: Optional[int] = setting(
        None, "context the model was trained on before YaRN (default 4096, "
        "MLATransformerConfig's)", "--yarn-original-max-position-embeddings")
    yarn_beta_fast: Optional[float] = setting(
        None, "YaRN's rotations bounding extrapolation (default 32)", "--yarn-beta-fast")
    yarn_beta_slow: Optional[float] = setting(
        None, "YaRN's rotations bounding interpolation (default 1)", "--yarn-beta-slow")
    yarn_correction_range_round_to_int: Optional[bool] = setting(
        None, "round YaRN's correction range to whole channels (default on; Hugging Face's "
        "rope_parameters.truncate)", "--yarn-correction-range-round-to-int",
        negative="--no-yarn-correction-range-round-to-int")


# MLASettings field -> TransformerConfig field (Megatron-Core's MLATransformerConfig names)
MLA_FIELDS: Dict[str, str] = {f.name: f.name for f in fields(MLASettings)}
MLA_FIELDS.update(yarn_original_max_position_embeddings="original_max_position_embeddings",
                  yarn_beta_fast="beta_fast", yarn_beta_slow="beta_slow")
_POSITIVE = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
             "v_head_dim", "yarn_original_max_position_embeddings", "mla_latent_norm_epsilon")


def mla_overrides(s: "Settings", zoo: Optional[Dict[str, Any]],
                  p: "Problems") -> Dict[str, Any]:
    """TransformerConfig fields the MLA/YaRN flags set (only those given); `zoo`: the --model
    config's fields (None without --model)."""
    m = s.mla
    out = {MLA_FIELDS[name]: getattr(m, name) for name in MLA_FIELDS
           if getattr(m, name) is not None}
    p.positive(s, *_POSITIVE)
    mla = bool(m.multi_latent_attention or (zoo or {}).get("multi_latent_attention"))
    if m.rope_type == "yarn" and not mla:
        p.add("--rope-type yarn needs --multi-latent-attention: Megatron-LM's other "
              "attention takes --rope-type rope only")
    if mla and s.model.group_query_attention:
        p.add("--multi-latent-attention and --group-query-attention are exclusive (as in "
              "Megatron-LM): drop --group-query-attention")
    return out
