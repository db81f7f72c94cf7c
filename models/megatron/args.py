"""A Megatron-LM checkpoint's saved `args` (its flags after Megatron's validation) -> gigatron's
TransformerConfig.

gigatron's flags are Megatron's, so most fields copy across by name. The derived values are
read as Megatron-LM left them after validate_args: ffn_hidden_size, kv_channels and
max_position_embeddings are filled in, bias_gelu_fusion is off without biases, and
num_query_groups counts only with group_query_attention (core_transformer_config_from_args
passes None, i.e. one group per head, otherwise). The MLP activation follows Megatron-Core's
MLP: the bias-GeLU fusion computes the tanh approximation, plain F.gelu the exact one.
"""
from __future__ import annotations

import argparse
from typing import Any, Dict, List, Optional, Tuple

from gigatron.models.config import TransformerConfig
from gigatron.models.hf_common import ConversionError
from gigatron.models.megatron.moe import moe_config_fields

# (args attribute, value that gigatron cannot run, what it is)
_UNSUPPORTED: Tuple[Tuple[str, Any, str], ...] = (
    ("use_legacy_models", True, "legacy (pre-Megatron-Core) models"),
    ("qk_l2_norm", True, "L2-normalised queries and keys"),
    ("rotary_interleaved", True, "interleaved RoPE"),
    ("quick_geglu", True, "the quick-GeGLU activation"),
    ("apply_residual_connection_post_layernorm", True, "residuals taken after the norm"),
    ("heterogeneous_layers_config_path", "any", "heterogeneous layers"),
    ("hybrid_layer_pattern", "any", "hybrid (Mamba) layers"),
    ("softmax_scale", "any", "a custom attention softmax scale"),
    ("moe_latent_size", "any", "experts in a latent space"),
    ("moe_apply_probs_on_input", True, "router probabilities applied to the experts' input"),
    ("moe_input_jitter_eps", "any", "router input jitter"),
    ("moe_router_topk_limited_devices", "any", "device-limited routing (use "
                                               "--moe-router-num-groups)"),
)
_POSITION_TYPES = ("learned_absolute", "rope", "none")
# multi-latent attention: TransformerConfig field <- saved args (Megatron-LM's dest first,
# then Megatron-Core's MLATransformerConfig name); None keeps MLATransformerConfig's default
_MLA_ARGS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("q_lora_rank", ("q_lora_rank",)), ("kv_lora_rank", ("kv_lora_rank",)),
    ("qk_head_dim", ("qk_head_dim",)), ("qk_pos_emb_head_dim", ("qk_pos_emb_head_dim",)),
    ("v_head_dim", ("v_head_dim",)), ("rope_type", ("rope_type",)),
    ("rotary_scaling_factor", ("rotary_scaling_factor",)), ("mscale", ("mscale",)),
    ("mscale_all_dim", ("mscale_all_dim",)),
    ("original_max_position_embeddings", ("yarn_original_max_position_embeddings",
                                          "original_max_position_embeddings")),
    ("beta_fast", ("yarn_beta_fast", "beta_fast")), ("beta_slow", ("yarn_beta_slow",
                                                                   "beta_slow")),
    ("yarn_correction_range_round_to_int", ("yarn_correction_range_round_to_int",)),
)


def _get(args: argparse.Namespace, *names: str, default: Any = None) -> Any:
    """The first of `names` that args holds with a value (older releases used other names)."""
    for name in names:
        value = getattr(args, name, None)
        if value is not None:
            return value
    return default


def unsupported(args: argparse.Namespace) -> List[str]:
    """Every feature of the saved run that gigatron's model cannot express, one line each."""
    out = [f"{name}={getattr(args, name)!r} ({what})" for name, bad, what in _UNSUPPORTED
           if getattr(args, name, None) not in (None, False, 0)
           and (bad == "any" or getattr(args, name) == bad)]
    kind = _position_type(args)
    if kind not in _POSITION_TYPES:
        out.append(f"position_embedding_type={kind!r} (supported: {', '.join(_POSITION_TYPES)})")
    if _get(args, "add_qkv_bias", default=False) and not _get(args, "add_bias_linear",
                                                              default=True):
        out.append("add_qkv_bias without add_bias_linear (gigatron has one add_bias_linear)")
    if _get(args, "num_experts") and _get(args, "add_bias_linear", default=True):
        out.append("add_bias_linear with num_experts (experts with biases: gigatron trains "
                   "them, but does not read Megatron-Core's expert and router biases)")
    return out


def mla_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """TransformerConfig fields of a multi-latent-attention run's saved args ({} without)."""
    if not _get(args, "multi_latent_attention", default=False):
        return {}
    fields: Dict[str, Any] = {"multi_latent_attention": True}
    for field, names in _MLA_ARGS:
        value = _get(args, *names)
        if value is not None:
            fields[field] = value
    return fields


def _position_type(args: argparse.Namespace) -> str:
    if _get(args, "use_rotary_position_embeddings", default=False):
        return "rope"
    return str(_get(args, "position_embedding_type", default="learned_absolute"))


def megatron_activation(swiglu: bool, squared_relu: bool, bias_gelu_fusion: bool,
                        add_bias_linear: bool) -> str:
    """The MLP activation Megatron-Core computes for these flags (the one rule for saved args
    and for pretrain_gpt.py's flags): the bias-GeLU fusion, on only with biases, is the tanh
    approximation; F.gelu otherwise is exact."""
    if swiglu:
        return "swiglu"
    if squared_relu:
        return "squared_relu"
    return "gelu_tanh" if bias_gelu_fusion and add_bias_linear else "gelu"


def activation(args: argparse.Namespace) -> str:
    """The activation Megatron-Core's MLP computes for the saved flags."""
    return megatron_activation(bool(_get(args, "swiglu", default=False)),
                               bool(_get(args, "squared_relu", default=False)),
                               bool(_get(args, "bias_gelu_fusion", default=False)),
                               bool(_get(args, "add_bias_linear", default=True)))


def query_groups(args: argparse.Namespace) -> int:
    """Key/value heads: num_query_groups counts only with group_query_attention."""
    if _get(args, "group_query_attention", default=False):
        return int(args.num_query_groups)
    return int(args.num_attention_heads)


def vocab_sizes(args: argparse.Namespace, vocab_size: Optional[int]) -> Tuple[int, int]:
    """(real vocabulary, Megatron's padded vocabulary). Megatron saves only the padded size
    (and --vocab-size when given): without `vocab_size` every padded row stays a token."""
    padded = _get(args, "padded_vocab_size")
    if padded is None:
        raise ConversionError("the saved args hold no padded_vocab_size: the vocabulary size "
                              "is unknown")
    real = vocab_size or _get(args, "vocab_size") or padded
    if not 0 < real <= padded:
        raise ConversionError(f"vocabulary size {real} is not in 1..{padded} (the "
                              f"checkpoint's padded_vocab_size): fix --vocab-size")
    return int(real), int(padded)


def config_from_megatron_args(args: argparse.Namespace, vocab_size: Optional[int] = None
                              ) -> TransformerConfig:
    """TransformerConfig of a Megatron-LM run's saved args (`vocab_size`: the tokenizer's real
    vocabulary, to drop Megatron's padding rows)."""
    problems = unsupported(args)
    if problems:
        raise ConversionError("the Megatron checkpoint uses what gigatron's model does not "
                              "support: " + "; ".join(problems))
    real, _ = vocab_sizes(args, vocab_size)
    heads = int(args.num_attention_heads)
    try:
        return TransformerConfig(
            num_layers=int(args.num_layers), hidden_size=int(args.hidden_size),
            num_attention_heads=heads, num_query_groups=query_groups(args),
            kv_channels=_get(args, "kv_channels"), ffn_hidden_size=_get(args, "ffn_hidden_size"),
            vocab_size=real, seq_length=int(args.seq_length),
            max_position_embeddings=_get(args, "max_position_embeddings"),
            make_vocab_size_divisible_by=int(_get(args, "make_vocab_size_divisible_by",
                                                  default=128)),
            position_embedding_type=_position_type(args),
            rotary_base=float(_get(args, "rotary_base", default=10000)),
            rotary_percent=float(_get(args, "rotary_percent", default=1.0)),
            rotary_seq_len_interpolation_factor=_get(args,
                                                     "rotary_seq_len_interpolation_factor"),
            rope_scaling=bool(_get(args, "use_rope_scaling", default=False)),
            rope_scaling_factor=float(_get(args, "rope_scaling_factor", default=8.0)),
            normalization=str(_get(args, "normalization", default="LayerNorm")),
            layernorm_zero_centered_gamma=bool(
                getattr(args, "apply_layernorm_1p", False)
                or getattr(args, "layernorm_zero_centered_gamma", False)),
            layernorm_epsilon=float(_get(args, "norm_epsilon", "layernorm_epsilon",
                                         default=1e-5)),
            qk_layernorm=bool(_get(args, "qk_layernorm", default=False)),
            activation=activation(args),
            add_bias_linear=bool(_get(args, "add_bias_linear", default=True)),
            untie_embeddings_and_output_weights=bool(
                _get(args, "untie_embeddings_and_output_weights", default=False)),
            hidden_dropout=float(_get(args, "hidden_dropout", default=0.1)),
            attention_dropout=float(_get(args, "attention_dropout", default=0.1)),
            init_method_std=float(_get(args, "init_method_std", default=0.02)),
            mtp_num_layers=_get(args, "mtp_num_layers"),
            mtp_loss_scaling_factor=float(_get(args, "mtp_loss_scaling_factor", default=0.1)),
            **moe_config_fields(args), **mla_fields(args))
    except ValueError as err:
        raise ConversionError(f"the saved args do not make a valid model: "
                              f"{str(err).replace(chr(10), '; ')}") from None
