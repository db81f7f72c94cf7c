"""Megatron-LM's --muon-* flags (issue 41) -> the ZeRO optimizer's MuonConfig.

Each flag keeps Megatron-LM's name, meaning and default (megatron/training/arguments.py):
--muon-momentum 0.9, --muon-nesterov off, --muon-num-ns-steps 5, --muon-coefficient-type
quintic, --muon-scale-mode spectral, --muon-extra-scale-factor 1, q/k/v split unless
--muon-no-split-qkv, --muon-fp32-matmul-prec medium, --muon-tp-mode duplicated,
--muon-scalar-optimizer adam. They act under --optimizer muon (and, as in Megatron-LM, are
ignored otherwise); --use-distributed-optimizer (or --zero-stage 1-3) makes it Megatron-Core's
layer-wise distributed Muon (docs/MUON.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.parallel.zero.muon.config import MuonConfig
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

COEFFICIENT_TYPES = ("simple", "quintic", "polar_express", "aol")


@dataclass(frozen=True)
class MuonSettings:
    """Muon's update of the matrices (--optimizer muon); Megatron-LM's defaults."""

    muon_momentum: float = setting(0.9, "EMA momentum of the gradient (torch.optim.Muon's: "
                                   "0.95)", "--muon-momentum")
    muon_nesterov: bool = setting(
        False, "orthogonalise the Nesterov blend of gradient and momentum",
        "--muon-nesterov", "--muon-use-nesterov")
    muon_num_ns_steps: int = setting(5, "Newton-Schulz iterations", "--muon-num-ns-steps")
    muon_coefficient_type: str = setting(
        "quintic", "Newton-Schulz coefficient set (emerging_optimizers' names; simple is "
        "torch.optim.Muon's)", "--muon-coefficient-type", choices=COEFFICIENT_TYPES)
    muon_scale_mode: str = setting(
        "spectral", "update scale: spectral sqrt(max(out, in)), shape_scaling "
        "sqrt(max(1, out/in)) (torch.optim.Muon's), unit_rms_norm sqrt(out/in)",
        "--muon-scale-mode", choices=("spectral", "unit_rms_norm", "shape_scaling"))
    muon_extra_scale_factor: float = setting(
        1.0, "extra factor on the update (0.2 with spectral: AdamW's update size, Moonlight)",
        "--muon-extra-scale-factor")
    muon_no_split_qkv: bool = setting(
        False, "orthogonalise a fused qkv weight whole (default: q, k and v apart)",
        "--muon-no-split-qkv")
    muon_fp32_matmul_prec: str = setting(
        "medium", "Newton-Schulz precision: medium iterates in bf16, high in fp32 (TF32 "
        "where the device has it); low is refused (not a torch precision)",
        "--muon-fp32-matmul-prec", choices=("low", "medium", "high"))
    muon_tp_mode: str = setting(
        "duplicated", "a tensor-parallel matrix: duplicated gathers it whole (equal to one "
        "device), distributed keeps it sharded and sums its Gram matrices over tp (equal to "
        "one device up to rounding), blockwise orthogonalises each shard (cheaper, depends on "
        "tp)", "--muon-tp-mode", choices=("blockwise", "duplicated", "distributed"))
    muon_scalar_optimizer: str = setting(
        "adam", "optimizer of embeddings, output layer, norms, biases: adam (AdamW with the "
        "--adam-* flags); lion is not built", "--muon-scalar-optimizer",
        choices=("adam", "lion"))


def muon_config(s: "Settings", model: Optional["TransformerConfig"],
                p: "Problems") -> Optional["MuonConfig"]:
    """The MuonConfig of --optimizer muon (None otherwise, or with its problems in `p`)."""
    from gigatron.parallel.zero.muon.config import MuonConfig, muon_problems
    from gigatron.training.config.table import flag_name

    if s.optimizer.optimizer != "muon":
        return None
    m = s.muon
    values = dict(momentum=m.muon_momentum, nesterov=m.muon_nesterov,
                  num_ns_steps=m.muon_num_ns_steps, coefficient_type=m.muon_coefficient_type,
                  scale_mode=m.muon_scale_mode, extra_scale_factor=m.muon_extra_scale_factor,
                  split_qkv=not m.muon_no_split_qkv, fp32_matmul_prec=m.muon_fp32_matmul_prec,
                  tp_mode=m.muon_tp_mode, scalar_optimizer=m.muon_scalar_optimizer,
                  qkv_split_shapes=_qkv_split_shapes(model))
    names = {field: flag_name("muon_" + field) for field in values
             if field not in ("split_qkv", "qkv_split_shapes")}
    lines = muon_problems(values, names)
    p.lines += lines
    return None if lines else MuonConfig(**values)


def _qkv_split_shapes(model: Optional["TransformerConfig"]):
    """Rows of q, k and v per query group of the fused qkv weight (as Megatron-Core)."""
    if model is None or getattr(model, "multi_latent_attention", False):
        return None
    d = model.head_dim
    return (model.num_attention_heads // model.num_query_groups * d, d, d)
