"""Model flags -> TransformerConfig, with Megatron-Core's meaning for each flag.

Without --model the flags describe the whole model and Megatron's derived defaults apply
(GeLU is the tanh approximation of the bias-GeLU fusion unless --no-bias-gelu-fusion or
--disable-bias-linear turns the fusion off; --group-query-attention alone is multi-query;
SwiGLU's MLP is 8/3 x hidden rounded down to 64). With --model the zoo config shows through
every flag left out. Problems are recorded (one line each), never raised one at a time.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

from gigatron.training.config.megatron.gpt_oss import gpt_oss_overrides
from gigatron.training.config.megatron.mla import mla_overrides
from gigatron.training.config.megatron.mtp import mtp_overrides
from gigatron.training.config.megatron.recompute import recompute_overrides
from gigatron.training.config.megatron.flag_words import in_flag_words
from gigatron.training.config.megatron.moe import moe_overrides
from gigatron.training.config.table import flag_name

if TYPE_CHECKING:
    import torch
    from gigatron.models.config import TransformerConfig
    from gigatron.training.config.settings import ModelSettings, PrecisionSettings
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

# flag dest -> TransformerConfig field, for flags that map one to one
MODEL_FIELDS = {
    "num_layers": "num_layers", "hidden_size": "hidden_size",
    "ffn_hidden_size": "ffn_hidden_size", "num_attention_heads": "num_attention_heads",
    "kv_channels": "kv_channels",
    "seq_length": "seq_length", "max_position_embeddings": "max_position_embeddings",
    "make_vocab_size_divisible_by": "make_vocab_size_divisible_by",
    "position_embedding_type": "position_embedding_type", "rotary_base": "rotary_base",
    "rotary_percent": "rotary_percent",
    "rotary_seq_len_interpolation_factor": "rotary_seq_len_interpolation_factor",
    "use_rope_scaling": "rope_scaling", "rope_scaling_factor": "rope_scaling_factor",
    "rope_scaling_low_freq_factor": "rope_scaling_low_freq_factor",
    "rope_scaling_high_freq_factor": "rope_scaling_high_freq_factor",
    "rope_scaling_original_max_position_embeddings":
        "rope_scaling_original_max_position_embeddings",
    "normalization": "normalization", "norm_epsilon": "layernorm_epsilon",
    "apply_layernorm_1p": "layernorm_zero_centered_gamma",
    "qk_layernorm": "qk_layernorm",
    "hidden_dropout": "hidden_dropout", "attention_dropout": "attention_dropout",
    "init_method_std": "init_method_std",
    "recompute_granularity": "recompute_granularity", "recompute_method": "recompute_method",
    "recompute_num_layers": "recompute_num_layers",
    "untie_embeddings_and_output_weights": "untie_embeddings_and_output_weights",
}
_POSITIVE_MODEL = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                   "kv_channels", "seq_length", "max_position_embeddings",
                   "make_vocab_size_divisible_by", "init_method_std", "recompute_num_layers",
                   "num_key_value_heads", "num_query_groups",
                   "rope_scaling_original_max_position_embeddings")
REQUIRED_WITHOUT_MODEL = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
# Megatron's --attention-backend (and gigatron's sdpa) -> TransformerConfig.attention_backend
ATTENTION_BACKENDS = {"auto": "sdpa", "flash": "sdpa", "fused": "sdpa", "sdpa": "sdpa",
                      "unfused": "unfused", "local": "unfused"}
_NORMALIZATION = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}  # Megatron-DeepSpeed's


def _activation(m: "ModelSettings", zoo: Optional[Dict[str, Any]],
                p: "Problems") -> Optional[str]:
    """The activation field the flags set; None: the zoo's stays."""
    from gigatron.models.megatron.args import megatron_activation

    if m.swiglu and m.squared_relu:
        p.add("--swiglu and --squared-relu are exclusive: pick one")
    fusion_off = m.no_bias_gelu_fusion or bool(m.disable_bias_linear)
    if zoo is None:
        return megatron_activation(bool(m.swiglu), bool(m.squared_relu),
                                   not m.no_bias_gelu_fusion, not m.disable_bias_linear)
    if m.swiglu or m.squared_relu:
        return "swiglu" if m.swiglu else "squared_relu"
    if fusion_off and zoo.get("activation", "gelu") in ("gelu", "gelu_tanh"):
        return "gelu"
    return None


def _query_groups(m: "ModelSettings", p: "Problems") -> Optional[int]:
    """Key/value heads: --group-query-attention [--num-query-groups N] (Megatron's default
    N = 1) or Megatron-DeepSpeed's --num-key-value-heads N; None: not set by the flags."""
    groups, kv_heads = m.num_query_groups, m.num_key_value_heads
    if kv_heads is not None:
        if groups is not None and groups != kv_heads:
            p.add(f"--num-key-value-heads {kv_heads} and --num-query-groups {groups} "
                  f"disagree: give one of them")
        return kv_heads
    if m.group_query_attention:
        return 1 if groups is None else groups
    if groups is not None and m.model is None:
        p.add("--num-query-groups is used only with --group-query-attention (Megatron "
              "ignores it without): add --group-query-attention")
    return groups


def _position_embedding(m: "ModelSettings", fields: Dict[str, Any], p: "Problems") -> None:
    kind = fields.get("position_embedding_type")
    if kind in ("mrope", "relative"):
        p.add(f"--position-embedding-type {kind} is not supported by gigatron: use rope, "
              f"learned_absolute or none")
    if m.use_rotary_position_embeddings:
        if kind not in (None, "rope"):
            p.add(f"--use-rotary-position-embeddings contradicts --position-embedding-type "
                  f"{kind}: drop one")
        fields["position_embedding_type"] = "rope"
    if m.no_position_embedding and fields.get("position_embedding_type") != "rope":
        p.add("--no-position-embedding works only with --position-embedding-type rope (as in "
              "Megatron, which deprecates it): drop it (--position-embedding-type none: no "
              "position embedding)")


def _attention_backend(s: "Settings", p: "Problems") -> Optional[str]:
    backend = s.model.attention_backend
    if s.implementation.use_flash_attn:
        if backend is not None and ATTENTION_BACKENDS[backend] != "sdpa":
            p.add(f"--use-flash-attn contradicts --attention-backend {backend}: drop one")
        backend = backend or "flash"
    return None if backend is None else ATTENTION_BACKENDS[backend]


def _recompute(s: "Settings", fields: Dict[str, Any], p: "Problems") -> None:
    """Megatron's --recompute-activations (selective) and Megatron-DeepSpeed's
    --checkpoint-activations (full, uniform chunks of --checkpoint-num-layers)."""
    m = s.model
    if s.implementation.use_legacy_models:
        p.add("--use-legacy-models is not supported: gigatron builds Megatron-Core's model "
              "only; drop it")
    if m.recompute_activations:  # Megatron sets it over --recompute-granularity
        fields["recompute_granularity"] = "selective"
        fields.pop("recompute_method", None)
    elif m.checkpoint_activations and m.recompute_granularity is None:
        fields.update(recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=m.checkpoint_num_layers)
    if fields.get("recompute_granularity") == "full":  # Megatron-DeepSpeed's default
        fields.setdefault("recompute_num_layers", 1)


def model_overrides(s: "Settings", vocab_size: Optional[int],
                    zoo: Optional[Dict[str, Any]], p: "Problems") -> Dict[str, Any]:
    """TransformerConfig fields set by the settings (only those given, so zoo values show
    through); `zoo`: the --model config's fields (None without --model)."""
    m = s.model
    fields = {f: getattr(m, d) for d, f in MODEL_FIELDS.items() if getattr(m, d) is not None}
    fields["normalization"] = _NORMALIZATION.get(fields.get("normalization", ""),
                                                 fields.get("normalization"))
    if fields["normalization"] is None:
        del fields["normalization"]
    _position_embedding(m, fields, p)
    _recompute(s, fields, p)
    activation = _activation(m, zoo, p)
    if activation is not None:
        fields["activation"] = activation
    if m.disable_bias_linear:
        fields["add_bias_linear"] = False
    groups = _query_groups(m, p)
    if groups is not None:
        fields["num_query_groups"] = groups
    backend = _attention_backend(s, p)
    if backend is not None:
        fields["attention_backend"] = backend
    if vocab_size is not None:
        fields["vocab_size"] = vocab_size
    fields.update(moe_overrides(s, zoo, p))
    fields.update(mla_overrides(s, zoo, p))
    fields.update(gpt_oss_overrides(s, p))  # after: --enable-gpt-oss's YaRN wins, as Megatron
    fields.update(mtp_overrides(s, fields, zoo, p))
    fields.update(recompute_overrides(s, fields, p))
    fields["sequence_parallel"] = bool(s.parallel.sequence_parallel and s.parallel.tp > 1)
    fields["params_dtype"] = params_dtype(s.precision)
    fields["attention_softmax_in_fp32"] = (s.precision.attention_softmax_in_fp32 or  # Megatron
                                           s.implementation.apply_query_key_layer_scaling)
    return fields


def params_dtype(precision: "PrecisionSettings") -> "torch.dtype":
    """The parameters' dtype of --fp16 / --bf16 (fp32 without either)."""
    import torch

    return torch.bfloat16 if precision.bf16 else torch.float16 if precision.fp16 \
        else torch.float32


def _megatron_defaults(fields: Dict[str, Any]) -> None:
    """Defaults Megatron derives from other flags when no zoo config is given."""
    if fields.get("activation") == "swiglu" and "ffn_hidden_size" not in fields:
        fields["ffn_hidden_size"] = int(4 * fields["hidden_size"] * 2 / 3 / 64) * 64
    fields.setdefault("max_position_embeddings", fields["seq_length"])


def build_model_config(s: "Settings", vocab_size: Optional[int], p: "Problems",
                       tokenizer_named: bool = False) -> Optional["TransformerConfig"]:
    """The TransformerConfig: --model's zoo config (if given) overridden by model flags;
    None (with the problems recorded) when it cannot be built. `vocab_size`: the tokenizer's
    (else --vocab-size's); `tokenizer_named`: the data settings name a tokenizer, whose own
    problem line says why it gave no vocabulary (none is added here)."""
    n, m, stand_in = len(p.lines), s.model, False
    p.positive(s, *_POSITIVE_MODEL)
    vocab = vocab_size if vocab_size is not None else s.data.vocab_size
    if m.model is not None:
        from gigatron.models.zoo import list_models, load_config, model_fields

        if m.model not in list_models():
            p.add(f"--model {m.model} is not in the zoo: choose one of "
                  f"{', '.join(list_models())}")
            return None
        fields = model_overrides(s, vocab, model_fields(m.model), p)
        build: Callable[..., "TransformerConfig"] = load_config
        args: Tuple = (m.model,)
    else:
        fields = model_overrides(s, vocab, None, p)
        missing = [flag_name(d) for d in REQUIRED_WITHOUT_MODEL if getattr(m, d) is None]
        if missing:
            p.add(f"{', '.join(missing)} required (or name a zoo model with --model)")
        if "vocab_size" not in fields:
            if not tokenizer_named:
                p.add("the vocabulary size is unknown: give --tokenizer-type and its files, "
                      "or --vocab-size with --mock-data")
            fields["vocab_size"], stand_in = 1, True  # the model's other rules still run
        if len(p.lines) == n:
            _megatron_defaults(fields)
        from gigatron.models.config import TransformerConfig

        build, args = TransformerConfig, ()
    if len(p.lines) > n:
        return None
    config = p.run(build, *args, **fields)
    if config is not None:
        p.lines += config.problems(s.parallel.tp)
    # the model's lines name its fields; this user typed flags
    p.lines[n:] = [in_flag_words(line) for line in p.lines[n:]]
    return config if len(p.lines) == n and not stand_in else None
