"""What TransformerConfig's multi-latent attention and YaRN fields must satisfy.

Kept apart from models/config.py (which calls `mla_problems` from its own `problems`);
nothing here imports a model module. Each line names the field and the fix.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig

ROPE_TYPES = ("rope", "yarn")
_SIZES = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
          "original_max_position_embeddings")


def mla_problems(config: "TransformerConfig", tp_size: int = 1) -> List[str]:
    """Every MLA / YaRN field that cannot run on `tp_size`, one line each."""
    out = []
    if config.rope_type not in ROPE_TYPES:
        out.append(f"rope_type={config.rope_type!r} is not one of {list(ROPE_TYPES)}")
    for name in ("rotary_scaling_factor", "beta_fast", "beta_slow"):
        if not getattr(config, name) > 0:
            out.append(f"{name} must be > 0, got {getattr(config, name)}")
    if not config.multi_latent_attention:
        return out
    bad = [name for name in _SIZES if not _positive_int(getattr(config, name))]
    q_rank = config.q_lora_rank
    if q_rank is not None and not _positive_int(q_rank):
        bad.append("q_lora_rank")
    out += [f"{name} must be a positive integer, got {getattr(config, name)!r}" for name in bad]
    if bad:
        return out
    return out + _layout_problems(config, tp_size)


def _layout_problems(config: "TransformerConfig", tp: int) -> List[str]:
    out = []
    if config.rotary_dim < 2 or config.rotary_dim % 2:
        out.append(f"MLA's RoPE rotates {config.rotary_dim} channels of qk_pos_emb_head_dim "
                   f"({config.qk_pos_emb_head_dim}): make it even and >= 2 "
                   f"(--qk-pos-emb-head-dim, --rotary-percent)")
    # the down-projections are column-parallel (Megatron-Core's local spec), their outputs
    # gathered: each rank holds a slice of the latent's channels
    if config.q_lora_rank is not None and config.q_lora_rank % tp:
        out.append(f"q_lora_rank ({config.q_lora_rank}) must be divisible by the "
                   f"tensor-parallel size ({tp}): MLA's down-projections are split over tp")
    latent = config.kv_lora_rank + config.qk_pos_emb_head_dim
    if latent % tp:
        out.append(f"kv_lora_rank + qk_pos_emb_head_dim ({latent}) must be divisible by the "
                   f"tensor-parallel size ({tp}): MLA's down-projections are split over tp")
    if config.rotary_seq_len_interpolation_factor is not None or config.rope_scaling:
        out.append("multi_latent_attention takes no --rotary-seq-len-interpolation-factor nor "
                   "--use-rope-scaling (Megatron-Core's MLA ignores them): use --rope-type yarn "
                   "with --rotary-scaling-factor")
    return out


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
