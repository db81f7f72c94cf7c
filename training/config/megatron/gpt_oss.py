"""The gpt-oss family's flags (issue 39): sliding windows, sink logits, quick GeGLU with its
offset and clamp, query/key/value biases and --enable-gpt-oss, with Megatron-LM's names,
meanings and defaults. The model side is models/attention_kinds.py; the settings become
TransformerConfig fields in `gpt_oss_overrides`, problems one line each naming the flag.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.training.config.table import Settings
    from gigatron.training.config.validation import Problems

# what --enable-gpt-oss sets, as Megatron-LM does: gpt-oss's YaRN RoPE (Hugging Face's
# rope_scaling of openai/gpt-oss-20b and -120b: factor 32 over an original 4096 context)
GPT_OSS_YARN: Dict[str, Any] = dict(
    position_embedding_type="rope", rope_type="yarn", rotary_scaling_factor=32.0,
    original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
    mscale_all_dim=0.0, yarn_correction_range_round_to_int=False)


@dataclass(frozen=True)
class GptOssSettings:
    """Attention and MLP kinds of the gpt-oss family (Megatron-LM's flags)."""

    window_size: Optional[str] = setting(
        None, "sliding-window attention: L,0 lets each query see the L keys before it and "
        "itself (Megatron-Core's window_size; -1,0: no window)", "--window-size",
        metavar="L,0")
    window_attn_skip_freq: Optional[str] = setting(
        None, "which layers keep full attention among the windowed: N = every Nth layer "
        "(1-based), or a Python list of 1 (window) / 0 (full) per layer; default: every "
        "layer windowed", "--window-attn-skip-freq", metavar="N|PATTERN")
    softmax_type: Optional[str] = setting(
        None, "attention softmax: vanilla, off-by-one (a sink logit 0) or learnable (one "
        "learned sink logit per head, gpt-oss) (model default vanilla)", "--softmax-type",
        choices=("vanilla", "off-by-one", "learnable"))
    quick_geglu: Optional[bool] = setting(
        None, "gated MLP with quick GeLU, x sigmoid(1.702 x) (gpt-oss)", "--quick-geglu")
    glu_linear_offset: Optional[float] = setting(
        None, "added to the linear half of a gated MLP: act(gate) * (linear + offset) "
        "(model default 0; gpt-oss 1)", "--glu-linear-offset")
    activation_func_clamp_value: Optional[float] = setting(
        None, "clamp a gated MLP's gate to <= this and its linear half to [-this, this] "
        "(gpt-oss 7)", "--activation-func-clamp-value")
    add_qkv_bias: Optional[bool] = setting(
        None, "biases on the query/key/value projection even with --disable-bias-linear",
        "--add-qkv-bias")
    enable_gpt_oss: bool = setting(
        False, "gpt-oss's YaRN RoPE, as Megatron-LM sets it: --rope-type yarn with "
        "--rotary-scaling-factor 32 over an original context of 4096, beta fast 32, beta "
        "slow 1, mscale 1, mscale-all-dim 0, no rounding of the correction range (the other "
        "architecture flags are given as Megatron's examples/gptoss scripts give them)",
        "--enable-gpt-oss")


def parse_window_size(text: str) -> List[int]:
    """--window-size as Megatron reads it: two integers 'L,R' (parentheses allowed)."""
    parts = text.strip().strip("()[]").split(",")
    try:
        values = [int(part) for part in parts]
    except ValueError:
        values = []
    if len(values) != 2:
        raise ValueError(f"--window-size {text!r}: give two integers L,0")
    return values


def parse_skip_freq(text: str) -> Union[int, List[int]]:
    """--window-attn-skip-freq as Megatron reads it (its --moe-layer-freq form)."""
    from gigatron.training.config.megatron.moe import parse_moe_layer_freq

    try:
        return parse_moe_layer_freq(text)
    except ValueError as err:
        raise ValueError(str(err).replace("--moe-layer-freq", "--window-attn-skip-freq")) \
            from None


def gpt_oss_overrides(s: "Settings", p: "Problems") -> Dict[str, Any]:
    """TransformerConfig fields the gpt-oss flags set (only those given)."""
    g, fields = s.gpt_oss, {}
    if g.window_size is not None:
        fields["window_size"] = p.run(parse_window_size, g.window_size)
    if g.window_attn_skip_freq is not None:
        fields["window_attn_skip_freq"] = p.run(parse_skip_freq, g.window_attn_skip_freq)
    for name in ("softmax_type", "glu_linear_offset", "activation_func_clamp_value",
                 "add_qkv_bias"):
        if getattr(g, name) is not None:
            fields[name] = getattr(g, name)
    if g.quick_geglu:
        if s.model.swiglu or s.model.squared_relu:
            p.add("--quick-geglu, --swiglu and --squared-relu are exclusive: pick one")
        fields["activation"] = "quick_geglu"
    if g.enable_gpt_oss:
        fields.update(GPT_OSS_YARN)
    return {name: value for name, value in fields.items() if value is not None}
