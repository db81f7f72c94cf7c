"""TransformerConfig: every architectural and parallelism knob of the model, in one place.

Field names follow Megatron-Core's TransformerConfig where one exists, so flags map 1:1.
`problems(tp_size)` lists every field that cannot run on a tensor-parallel size (naming the
field and the fix); `validate(tp_size)` raises them as one ValueError, one per line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Union

import torch

from gigatron.models.attention_kinds import attention_kind_problems
from gigatron.models.mla.checks import mla_problems
from gigatron.models.moe.config_checks import moe_problems

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
_CHOICES = {
    "position_embedding_type": ("learned_absolute", "rope", "none"),
    "normalization": ("LayerNorm", "RMSNorm"),
    "activation": ("gelu", "gelu_tanh", "swiglu", "squared_relu", "quick_geglu"),
    "attention_backend": ("sdpa", "unfused"),
    "softmax_type": ("vanilla", "off-by-one", "learnable"),
    "recompute_granularity": (None, "full", "selective"),
    "recompute_method": (None, "uniform", "block"),
}
# Default of the fields __post_init__ derives from others: None at run time (so flags, JSON
# and callers keep passing None for "derive it"), and the field is typed as the resolved value.
_DERIVED: Any = None


@dataclass
class TransformerConfig:
    """Architecture, initialisation and memory knobs of a GPT-style decoder."""

    num_layers: int
    """Number of transformer layers (--num-layers)."""
    hidden_size: int
    """Width of the residual stream (--hidden-size)."""
    num_attention_heads: int
    """Query heads (--num-attention-heads); head dim = hidden_size / heads."""
    vocab_size: int
    """Real tokenizer vocab; padded up for the embedding table (see below)."""
    seq_length: int = 1024
    """Tokens per sample (--seq-length)."""
    ffn_hidden_size: int = _DERIVED
    """MLP inner width (--ffn-hidden-size); default 4 x hidden_size."""
    num_query_groups: int = _DERIVED
    """Key/value heads for GQA/MQA (--num-query-groups); default = num_attention_heads."""
    max_position_embeddings: int = _DERIVED
    """Rows of the learned position table (--max-position-embeddings); default seq_length."""
    make_vocab_size_divisible_by: int = 128
    """Pad vocab to a multiple of this x tp (--make-vocab-size-divisible-by)."""
    position_embedding_type: str = "learned_absolute"
    """'learned_absolute' (GPT-2/3), 'rope' (Llama) or 'none' (--position-embedding-type)."""
    rotary_base: float = 10000.0
    """RoPE base theta (--rotary-base); Llama 3 uses 500000."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels RoPE rotates (--rotary-percent); the rest pass."""
    rotary_seq_len_interpolation_factor: Optional[float] = None
    """Positions divided by this before RoPE (--rotary-seq-len-interpolation-factor)."""
    rope_scaling: bool = False
    """Llama 3.1's RoPE frequency scaling (--use-rope-scaling), as Megatron-Core applies it
    (the three fields below default to Megatron-Core's fixed values)."""
    rope_scaling_factor: float = 8.0
    """Factor of the Llama 3.1 scaling (--rope-scaling-factor; HF rope_scaling.factor)."""
    rope_scaling_low_freq_factor: float = 1.0
    """Wavelengths above original context / this are slowed by the factor (HF
    rope_scaling.low_freq_factor)."""
    rope_scaling_high_freq_factor: float = 4.0
    """Wavelengths below original context / this are kept (HF
    rope_scaling.high_freq_factor)."""
    rope_scaling_original_max_position_embeddings: int = 8192
    """Context the scaled model was trained on (HF
    rope_scaling.original_max_position_embeddings)."""
    kv_channels: int = _DERIVED
    """Channels per attention head (--kv-channels); default hidden_size / heads."""
    normalization: str = "LayerNorm"
    """'LayerNorm' or 'RMSNorm' (--normalization)."""
    layernorm_zero_centered_gamma: bool = False
    """Norm weights stored zero-centred and applied as 1 + w, initialised to 0
    (--apply-layernorm-1p); every norm of the model, LayerNorm or RMSNorm."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the norms (--norm-epsilon)."""
    qk_layernorm: bool = False
    """Normalise each attention head's query and key over its kv_channels before RoPE, one
    weight per channel shared by the heads (--qk-layernorm; Qwen3's q_norm / k_norm): the
    model's normalization type, layernorm_epsilon, zero-centred with it."""
    activation: str = "gelu"
    """MLP activation: 'gelu' (exact, erf), 'gelu_tanh' (the tanh approximation: Megatron's
    default bias-GeLU fusion, GPT-2's gelu_new), 'swiglu', 'squared_relu' or 'quick_geglu'
    (--quick-geglu: x sigmoid(1.702 x) gating a linear half, gpt-oss)."""
    glu_linear_offset: float = 0.0
    """Added to the linear half of a gated unit: act(gate) * (up + offset)
    (--glu-linear-offset; gpt-oss: 1)."""
    activation_func_clamp_value: Optional[float] = None
    """A gated unit's gate clamped to <= this and its linear half to [-this, this] before
    the activation (--activation-func-clamp-value; gpt-oss: 7)."""
    add_bias_linear: bool = True
    """Biases on all linear layers (--disable-bias-linear turns off)."""
    add_qkv_bias: bool = False
    """Biases on the query/key/value projection even without add_bias_linear
    (--add-qkv-bias)."""
    window_size: Optional[Tuple[int, int]] = None
    """Sliding-window attention (--window-size L,0): a query sees the L keys before it and
    itself; None or L = -1: no window (Megatron-Core's window_size)."""
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None
    """Which layers keep full attention among windowed ones (--window-attn-skip-freq): N =
    every Nth layer (1-based) is full, or 1 (window) / 0 (full) per layer; None: all windowed."""
    softmax_type: str = "vanilla"
    """'vanilla', 'off-by-one' (a sink logit 0 in every softmax) or 'learnable' (one learned
    sink logit per head, gpt-oss's sinks) (--softmax-type)."""
    untie_embeddings_and_output_weights: bool = False
    """Separate output layer instead of reusing the word embeddings."""
    hidden_dropout: float = 0.1
    """Dropout on the residual branches and embeddings (--hidden-dropout)."""
    attention_dropout: float = 0.1
    """Dropout on attention probabilities (--attention-dropout)."""
    init_method_std: float = 0.02
    """Std of the normal init of weights (--init-method-std)."""
    apply_scaled_init: bool = True
    """Output projections (attention proj, fc2) get std / sqrt(2 * num_layers)."""
    params_dtype: torch.dtype = torch.float32
    """Dtype of parameters: fp32 | bf16 | fp16 (the names are accepted and resolved)."""
    attention_backend: str = "sdpa"
    """'sdpa' (torch scaled_dot_product_attention) or 'unfused' (softmax via gigatron.ops)."""
    attention_softmax_in_fp32: bool = True
    """The unfused softmax of fp16/bf16 scores in fp32; False: in their dtype, as Megatron's
    torch softmax without --attention-softmax-in-fp32 (Megatron-Core's default: True)."""
    sequence_parallel: bool = False
    """Split norms/dropout along the sequence across tp (--sequence-parallel)."""
    recompute_granularity: Optional[str] = None
    """None, 'full' (whole layers) or 'selective' (core attention) (--recompute-granularity)."""
    recompute_method: Optional[str] = None
    """For full: 'uniform' (chunks of N layers) or 'block' (first N layers) (--recompute-method)."""
    recompute_num_layers: Optional[int] = None
    """N of the recompute method (--recompute-num-layers)."""
    recompute_modules: Optional[List[str]] = None
    """With selective: what is recomputed (--recompute-modules; Megatron-Core's names, None:
    its default ['core_attn']); see RECOMPUTE_MODULES."""
    selective_ac_option: Optional[str] = None
    """With selective: 'op' recomputes by torchtitan's op-level rule instead of by module
    (--selective-ac-option; parallel/tensor/selective.py)."""
    # Mixture of experts (issue 27): Megatron-Core's TransformerConfig names and defaults;
    # the checks are in models/moe/config_checks.py.
    num_moe_experts: Optional[int] = None
    """Routed experts per MoE layer (--num-experts); None: a dense model."""
    moe_ffn_hidden_size: int = _DERIVED
    """Inner width of each routed expert (--moe-ffn-hidden-size); default ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts each token is sent to (--moe-router-topk)."""
    moe_router_score_function: str = "softmax"
    """'softmax' or 'sigmoid' of the router logits (--moe-router-score-function)."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before top-k instead of over the top-k
    (--moe-router-pre-softmax)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiplies the chosen experts' weights (--moe-router-topk-scaling-factor)."""
    moe_router_num_groups: Optional[int] = None
    """Expert groups of group-limited routing (--moe-router-num-groups, DeepSeek-V3)."""
    moe_router_group_topk: Optional[int] = None
    """Groups a token may pick its experts from (--moe-router-group-topk)."""
    moe_router_load_balancing_type: str = "aux_loss"
    """'aux_loss', 'seq_aux_loss', 'sinkhorn' or 'none' (--moe-router-load-balancing-type)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss in the training loss (--moe-aux-loss-coeff)."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss, None: off (--moe-z-loss-coeff)."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing by a per-expert routing bias (--moe-router-enable-expert-bias)."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update after each optimizer step
    (--moe-router-bias-update-rate)."""
    moe_expert_capacity_factor: Optional[float] = None
    """Token slots per expert as a multiple of the even share; None (or negative, as
    Megatron-Core): dropless (--moe-expert-capacity-factor)."""
    moe_token_drop_policy: str = "probs"
    """Over capacity, drop the lowest 'probs' or the latest 'position'
    (--moe-token-drop-policy)."""
    moe_pad_expert_input_to_capacity: bool = False
    """Fill every expert up to its capacity (--moe-pad-expert-input-to-capacity)."""
    moe_grouped_gemm: bool = False
    """The local experts' matmuls as one grouped matmul (--moe-grouped-gemm); same numbers."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Inner width of the shared experts every token goes through
    (--moe-shared-expert-intermediate-size); None: no shared expert."""
    moe_shared_expert_gate: bool = False
    """Megatron-Core's sigmoid gate on the shared experts (--moe-shared-expert-gate): refused."""
    moe_layer_freq: Union[int, List[int]] = 1
    """Which layers are MoE (--moe-layer-freq): N = layers 0, N, 2N, ..., or 0/1 per layer."""
    moe_token_dispatcher_type: str = "allgather"
    """How tokens reach their experts' ranks: 'allgather' or 'alltoall'
    (--moe-token-dispatcher-type)."""
    moe_router_dtype: Optional[str] = None
    """Dtype of the router logits and routing: None (the input's), 'fp32' or 'fp64'
    (--moe-router-dtype)."""
    moe_router_force_load_balancing: bool = False
    """Random router logits for benchmarking (--moe-router-force-load-balancing)."""
    # Multi-latent attention and YaRN (DeepSeek-V2/V3, issue 39): Megatron-Core's
    # MLATransformerConfig names, Megatron-LM's flag defaults; checks in models/mla/checks.py.
    multi_latent_attention: bool = False
    """Multi-latent attention instead of MHA/GQA (--multi-latent-attention)."""
    q_lora_rank: Optional[int] = None
    """Rank of the compressed query (--q-lora-rank); None: queries projected directly."""
    kv_lora_rank: int = 32
    """Rank of the compressed key/value latent (--kv-lora-rank)."""
    qk_head_dim: int = 128
    """Query/key channels per head without position (--qk-head-dim)."""
    qk_pos_emb_head_dim: int = 64
    """Query/key channels per head that RoPE rotates, the key's shared by every head
    (--qk-pos-emb-head-dim)."""
    v_head_dim: int = 128
    """Value channels per head (--v-head-dim)."""
    mla_latent_norm_epsilon: Optional[float] = None
    """Epsilon of the latent norms q_layernorm and kv_layernorm (--mla-latent-norm-epsilon);
    None: layernorm_epsilon, as Megatron-Core builds them. Hugging Face's DeepSeek-V2/V3 give
    them 1e-6 whatever rms_norm_eps is (Moonlight: 1e-5 for the others)."""
    rope_type: str = _DERIVED
    """MLA's RoPE: 'rope' or 'yarn' (--rope-type); default yarn with MLA (Megatron-Core's
    MLATransformerConfig), else rope."""
    rotary_scaling_factor: float = 1.0
    """YaRN's context-extension factor (--rotary-scaling-factor); MLA's softmax scale grows
    by its mscale_all_dim term whatever rope_type is (Megatron-Core)."""
    original_max_position_embeddings: int = 4096
    """Context the model was trained on before YaRN (--yarn-original-max-position-embeddings)."""
    beta_fast: float = 32.0
    """YaRN's rotations bounding extrapolation (--yarn-beta-fast)."""
    beta_slow: float = 1.0
    """YaRN's rotations bounding interpolation (--yarn-beta-slow)."""
    mscale: float = 1.0
    """YaRN's cos/sin concentration numerator (--mscale)."""
    mscale_all_dim: float = 0.0
    """YaRN's concentration denominator and MLA's softmax-scale term (--mscale-all-dim)."""
    yarn_correction_range_round_to_int: bool = True
    """Round YaRN's correction range to whole channels
    (--[no-]yarn-correction-range-round-to-int; Hugging Face's rope_parameters.truncate)."""
    # Multi-token prediction (DeepSeek-V3, issue 39): Megatron-Core's names and defaults.
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths on the last pipeline stage (--mtp-num-layers); None: none."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the depths' mean loss in the training loss (--mtp-loss-scaling-factor)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        # Megatron needs hidden_size divisible by heads only when kv_channels is derived
        self._kv_channels_derived = self.kv_channels is None
        if self.kv_channels is None and _positive_int(self.num_attention_heads) \
                and _positive_int(self.hidden_size):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.rope_type is None:
            self.rope_type = "yarn" if self.multi_latent_attention else "rope"
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        factor = self.moe_expert_capacity_factor
        if factor is not None and factor < 0:  # Megatron-Core's "dropless"
            self.moe_expert_capacity_factor = None
        if self.window_size is not None:  # JSON gives a list
            self.window_size = tuple(self.window_size)  # type: ignore[assignment]
        if isinstance(self.params_dtype, str):
            if self.params_dtype not in _DTYPES:
                raise ValueError(f"params_dtype {self.params_dtype!r} is unknown: use "
                                 f"fp32, bf16 or fp16")
            self.params_dtype = _DTYPES[self.params_dtype]
        self.validate(1)

    @property
    def head_dim(self) -> int:
        """Channels per attention head (Megatron-Core's kv_channels)."""
        return self.kv_channels

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates: kv_channels x rotary_percent (Megatron-Core's
        truncation); with MLA qk_pos_emb_head_dim (x rotary_percent under rope_type rope)."""
        if self.multi_latent_attention:
            dim = self.qk_pos_emb_head_dim
            return int(dim * self.rotary_percent) if self.rope_type == "rope" and \
                self.rotary_percent < 1.0 else dim
        if self.rotary_percent < 1.0:
            return int(self.kv_channels * self.rotary_percent)
        return self.kv_channels

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Vocab rounded up to a multiple of make_vocab_size_divisible_by x tp_size."""
        multiple = self.make_vocab_size_divisible_by * tp_size
        return math.ceil(self.vocab_size / multiple) * multiple

    def validate(self, tp_size: int = 1) -> None:
        """Raise a ValueError listing every reason (one per line) this config cannot run on
        `tp_size`."""
        problems = self.problems(tp_size)
        if problems:
            raise ValueError("\n".join(problems))

    def problems(self, tp_size: int = 1) -> List[str]:
        """Every reason this config cannot run on `tp_size`, each naming the field and fix."""
        ints = []
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                     "seq_length", "ffn_hidden_size", "num_query_groups",
                     "max_position_embeddings", "make_vocab_size_divisible_by", "kv_channels",
                     "rope_scaling_original_max_position_embeddings"):
            value = getattr(self, name)
            if not _positive_int(value):
                ints.append(f"{name} must be a positive integer, got {value!r}")
        out = list(ints)
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                out.append(f"{name}={getattr(self, name)!r} is not one of "
                           f"{[a for a in allowed if a is not None]}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                out.append(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.mtp_num_layers is not None and not _positive_int(self.mtp_num_layers):
            out.append(f"mtp_num_layers must be a positive integer, got {self.mtp_num_layers!r}")
        if not ints:  # the shape rules divide by these sizes
            out += self._shape_problems(tp_size) + self._rope_problems()
        return (out + self._recompute_problems() + moe_problems(self, tp_size)
                + mla_problems(self, tp_size)
                + attention_kind_problems(self))

    def _shape_problems(self, tp: int) -> List[str]:
        rules = [
            (not getattr(self, "_kv_channels_derived", True)
             or self.hidden_size % self.num_attention_heads == 0,
             f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
             f"({self.num_attention_heads}): change either, or give kv_channels"),
            (self.num_attention_heads % self.num_query_groups == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
             f"num_query_groups ({self.num_query_groups})"),
            (self.num_attention_heads % tp == 0,
             f"num_attention_heads ({self.num_attention_heads}) must be divisible by the "
             f"tensor-parallel size ({tp}): change --tensor-model-parallel-size or heads"),
            (self.num_query_groups % tp == 0,
             f"num_query_groups ({self.num_query_groups}) must be divisible by the "
             f"tensor-parallel size ({tp}): change --tensor-model-parallel-size or groups"),
            (self.ffn_hidden_size % tp == 0,
             f"ffn_hidden_size ({self.ffn_hidden_size}) must be divisible by the "
             f"tensor-parallel size ({tp})"),
            (not (self.sequence_parallel and tp > 1 and self.seq_length % tp),
             f"seq_length ({self.seq_length}) must be divisible by the tensor-parallel size "
             f"({tp}) with sequence_parallel"),
            (self.position_embedding_type != "learned_absolute"
             or self.seq_length <= self.max_position_embeddings,
             f"seq_length ({self.seq_length}) exceeds max_position_embeddings "
             f"({self.max_position_embeddings})"),
        ]
        return [message for ok, message in rules if not ok]

    def _rope_problems(self) -> List[str]:
        out = []
        if not 0.0 < self.rotary_percent <= 1.0:
            out.append(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        elif self.position_embedding_type == "rope" and not self.multi_latent_attention and (
                self.rotary_dim < 2 or self.rotary_dim % 2):
            out.append(f"RoPE rotates kv_channels x rotary_percent = {self.kv_channels} x "
                       f"{self.rotary_percent} -> {self.rotary_dim} channels per head, which "
                       f"must be even and >= 2: change --rotary-percent or --kv-channels")
        for name in ("rotary_base", "rope_scaling_factor", "rope_scaling_low_freq_factor",
                     "rope_scaling_high_freq_factor"):
            if not getattr(self, name) > 0:
                out.append(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.rope_scaling_low_freq_factor < self.rope_scaling_high_freq_factor:
            out.append(f"rope_scaling_low_freq_factor ({self.rope_scaling_low_freq_factor}) "
                       f"must be below rope_scaling_high_freq_factor "
                       f"({self.rope_scaling_high_freq_factor}): Llama 3.1's scaling blends "
                       f"the band between them")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and not factor > 0:
            out.append(f"rotary_seq_len_interpolation_factor must be > 0, got {factor}")
        return out

    def recomputes(self, module: str) -> bool:
        """Whether selective recomputation checkpoints `module` (a RECOMPUTE_MODULES name)."""
        modules = ["core_attn"] if self.recompute_modules is None else self.recompute_modules
        return self.recompute_granularity == "selective" and \
            self.selective_ac_option is None and module in modules

    def _recompute_problems(self) -> List[str]:
        out = [f"recompute_modules: {m!r} is not one of {', '.join(RECOMPUTE_MODULES)}"
               if m not in RECOMPUTE_MODULES else f"recompute_modules: {m!r} is "
               f"{RECOMPUTE_MODULES[m]}" for m in self.recompute_modules or ()
               if RECOMPUTE_MODULES.get(m, "?")]
        if self.selective_ac_option not in (None, "op"):
            out.append(f"selective_ac_option must be None or 'op', got "
                       f"{self.selective_ac_option!r}")
        if self.selective_ac_option is not None and self.recompute_modules is not None:
            out.append("selective_ac_option='op' replaces recompute_modules: set one")
        if self.selective_ac_option is not None and self.recompute_granularity != "selective":
            out.append("selective_ac_option needs recompute_granularity='selective'")
        return out + self._recompute_method_problems()

    def _recompute_method_problems(self) -> List[str]:
        if self.recompute_granularity == "full":
            out = []
            if self.recompute_method is None:
                out.append("recompute_method must be 'uniform' or 'block' with "
                           "recompute_granularity='full'")
            n = self.recompute_num_layers
            if not isinstance(n, int) or n < 1:
                out.append(f"recompute_num_layers must be a positive integer with "
                           f"recompute_granularity='full', got {n!r}")
            return out
        if self.recompute_method is not None:
            return [f"recompute_method={self.recompute_method!r} needs "
                    f"recompute_granularity='full' (selective takes no method)"]
        return []


# Megatron-Core's --recompute-modules -> "" (implemented) or why not
RECOMPUTE_MODULES = {
    "core_attn": "", "mlp": "", "moe": "", "shared_experts": "", "layernorm": "",
    "mla_up_proj": "",
    "moe_act": "not implemented: recompute the whole 'moe' layer",
}


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
