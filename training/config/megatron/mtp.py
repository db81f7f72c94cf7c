"""Megatron-LM's multi-token prediction flags (issue 39) -> TransformerConfig.

--mtp-num-layers (default: none) and --mtp-loss-scaling-factor (default 0.1) keep
Megatron-LM's names, meanings and defaults and set Megatron-Core's TransformerConfig fields
of the same names; the model side is models/mtp/. As with Megatron-Core's default layout,
the MTP modules sit on the last pipeline stage. Megatron-LM's other --mtp-* flags (a
standalone MTP stage, repeated or detached heads, hybrid patterns) are refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems


@dataclass(frozen=True)
class MTPSettings:
    """Multi-token prediction (DeepSeek-V3; Megatron-LM's defaults)."""

    mtp_num_layers: Optional[int] = setting(
        None, "multi-token prediction depths on the last pipeline stage, depth k predicting "
        "the token k + 1 places ahead (DeepSeek-V3: 1; default: none)", "--mtp-num-layers")
    mtp_loss_scaling_factor: float = setting(
        0.1, "weight of the depths' mean loss in the training loss (its loss is logged apart "
        "as 'mtp_k loss')", "--mtp-loss-scaling-factor")


def mtp_overrides(s: "Settings", fields: Dict[str, Any], zoo: Optional[Dict[str, Any]],
                  p: "Problems") -> Dict[str, Any]:
    """TransformerConfig fields the MTP flags set; `fields`: the other model flags' (for the
    position embedding), `zoo`: the --model config's fields (None without --model)."""
    m = s.mtp
    if m.mtp_num_layers is None:
        return {}
    p.positive(s, "mtp_num_layers")
    if s.parallel.context_parallel_size > 1:
        p.add("--mtp-num-layers with --context-parallel-size > 1 is not implemented (the "
              "rolled tokens would cross context-parallel ranks): use "
              "--context-parallel-size 1")
    if s.parallel.pp > 1 and s.parallel.pipeline_schedule == "zbv":
        # the V puts the embedding and the last stage (with MTP's copy of it) on rank 0 as
        # two chunks: the copies' grads would need a local sum the embedding group does not do
        p.add("--mtp-num-layers with --pipeline-schedule zbv is not supported (the first and "
              "last stages share rank 0): use --pipeline-schedule zb-h1, 1f1b or interleaved")
    position = fields.get("position_embedding_type",
                          (zoo or {}).get("position_embedding_type", "learned_absolute"))
    if s.parallel.pp > 1 and position == "learned_absolute":
        p.add("--mtp-num-layers with --pipeline-model-parallel-size > 1 needs "
              "--position-embedding-type rope or none (the last stage would need a copy of "
              "the learned position table)")
    return {"mtp_num_layers": m.mtp_num_layers,
            "mtp_loss_scaling_factor": m.mtp_loss_scaling_factor}
