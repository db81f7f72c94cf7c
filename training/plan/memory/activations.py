"""Activations by formula: Korthikanti et al.'s per-layer count written tensor by tensor for
this implementation, MoE layers, multi-token prediction, and what a chunk of layers keeps
per micro-batch under each recomputation (see the package docstring)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, List, Optional, Sequence, Tuple

from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.training.plan.context import NONE, ContextLayout, attention_held
from gigatron.training.plan.memory.state import dtype_bytes
from gigatron.training.plan.mla import mla_attention_bytes, mla_context_bytes
from gigatron.training.plan.parameters import is_expert_parallel
from gigatron.training.plan.recompute import op_layer_bytes, selective_layer_bytes

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig


@dataclass(frozen=True)
class ActivationTerms:
    """Bytes autograd keeps per token of one micro-batch, for one layer and the ends."""

    layer: float  # one transformer layer, nothing recomputed
    layer_selective: float  # one layer under --recompute-granularity selective
    layer_input: float  # what a fully recomputed block keeps: its input
    first_stage: float  # embedding: token/position ids, its dropout mask
    last_stage: float  # final norm, output-layer input, the loss's fp32 softmax
    per_layer_constant: float = 0.0  # per layer, not per token (a causal mask)
    per_chunk_constant: float = 0.0  # per chunk (RoPE tables shared by its layers)
    moe_layer: float = 0.0  # an MoE layer (`moe_mlp_bytes` in the MLP's place)
    moe_layer_selective: float = 0.0
    notes: List[str] = field(default_factory=list)
    mtp: float = 0.0  # the multi-token prediction depths, on the last stage (`mtp_bytes`)


def attention_kernel(c: "TransformerConfig", on_gpu: bool) -> str:
    """Which attention path runs: 'flash' (fused, no s x s tensor kept), 'math' (torch's
    sdpa fallback: CPU with attention dropout) or 'unfused' (gigatron.ops softmax)."""
    if c.attention_backend == "unfused":
        return "unfused"
    return "flash" if on_gpu or c.attention_dropout == 0 else "math"


def routed_share(tp: int, ep: int, etp: int) -> Tuple[float, int]:
    """(tokens one rank routes per token of the micro-batch, the experts' effective etp):
    expert-parallel, each tp rank routes its sequence slice and its experts hold 1/etp of
    the ffn (Megatron-Core's layout); otherwise every tp rank routes every token through
    whole experts (models/moe/layer.py without expert parallelism)."""
    return (1 / tp, etp) if is_expert_parallel(tp, ep, etp) else (1.0, 1)


def moe_mlp_bytes(c: "TransformerConfig", tp: int, ep: int, etp: int) -> float:
    """What an MoE layer's MLP part keeps per token of the micro-batch on one rank: each
    rank's experts compute the rows of its etp group's routed tokens (all-gathered), for
    1/etp of the ffn (`routed_share`); routing is taken as balanced."""
    w, h, e, k = dtype_bytes(c.params_dtype), c.hidden_size, c.num_moe_experts, c.moe_router_topk
    assert e is not None and c.moe_ffn_hidden_size is not None
    router_width = {"fp32": 4, "fp64": 8}.get(c.moe_router_dtype or "", w)
    glu = 4 if c.activation in ("swiglu", "quick_geglu") else 2
    share, etp = routed_share(tp, ep, etp)
    # router: its input (a cast copy under --moe-router-dtype), logits, scores, the
    # balancing losses' fp32 scores and the bool routing map
    router = share * (router_width * h + (2 * router_width + 4 + 1) * e)
    rows = k * etp * share  # expert rows on this rank
    experts = rows * (w * h + glu * w * c.moe_ffn_hidden_size / etp)
    # back on the token's rank: the expert outputs and probabilities weighted together,
    # the permutation's int64 token indices
    combine = k * share * (w * h + 4 + 8)
    shared = c.moe_shared_expert_intermediate_size
    shared_mlp = w * h + glu * w * shared / tp if shared else 0.0
    return router + experts + combine + shared_mlp


def activation_terms(c: "TransformerConfig", tp: int, on_gpu: bool, ep: int = 1,
                     etp: Optional[int] = None, context: ContextLayout = NONE
                     ) -> ActivationTerms:
    """Korthikanti's per-layer count, tensor by tensor, for this implementation (bytes per
    token; see the module docstring). `on_gpu`: CUDA kernels (bool dropout masks, fused
    norms) rather than the CPU reference paths (fp32 norm copies, float dropout masks);
    `context`: the cp attention's own tensors (context.py) in the core attention's place."""
    w = dtype_bytes(c.params_dtype)
    h, a, g, d, ffn = c.hidden_size, c.num_attention_heads, c.num_query_groups, c.head_dim, \
        c.ffn_hidden_size
    s, t = c.seq_length, tp
    sp = c.sequence_parallel and tp > 1
    split = t if sp else 1  # what sequence parallelism splits (else replicated on tp ranks)
    mask = 1 if on_gpu else w  # bytes of one dropout-mask element
    hidden_mask = mask if c.hidden_dropout > 0 else 0
    attn_mask = mask if c.attention_dropout > 0 else 0
    rms = c.normalization == "RMSNorm"
    if on_gpu:
        norm = w * h + 8
    elif rms:
        norm = 8 * h + 4  # fp32 input copy (or itself) and normalized output, rstd
    else:
        norm = 4 * h + 8  # fp32 input (a copy under bf16/fp16), mean and rstd
    rope = c.position_embedding_type == "rope"
    kernel = "flash" if context.cp > 1 else attention_kernel(c, on_gpu)
    q_view, k_view, v_view = not rope, not rope and g == a, g == a
    qkv_storage = w * g * (a // g + 2) * d / t
    copies = (0 if q_view else w * a * d) + (0 if k_view else w * a * d) + \
        (0 if v_view else w * a * d)
    ad = a * d / t  # attention channels on this rank
    # the storages the core attention's inputs keep (checkpointed under selective recompute)
    inputs = (qkv_storage if (q_view or k_view or v_view) else 0) + copies / t
    cp_constant = 0.0
    if kernel == "math":  # fp32 copies of q, k (scaled) and, unless a view, v
        held = 2 * 4 * ad + (0 if (w == 4 and v_view) else 4 * ad) + \
            (qkv_storage if (w == 4 and v_view) else 0)
        core = 3 * 4 * (a / t) * s
    elif context.cp > 1:  # torch's fused kernels per block or gathered sequence
        held, cp_constant = attention_held(context, qkv_storage if q_view else w * ad, w,
                                           ad, s)
        core = 4 * a / t
    else:
        held = inputs
        if kernel == "flash":  # its output is the projection's input (counted there)
            core = 4 * a / t  # log-sum-exp
        elif on_gpu:  # fused scale-mask-softmax keeps its output; dropout mask and output
            core = (2 * w + attn_mask) * (a / t) * s
        else:  # reference softmax: scores, exp (fp32), probabilities, dropout mask
            core = (2 * 4 + w + attn_mask) * (a / t) * s + 8 * a / t
    if c.multi_latent_attention and kernel == "flash" and context.cp == 1:  # training/plan/mla.py
        (held, inputs), core, ad = mla_attention_bytes(c, w, t, on_gpu), 0.0, \
            a * c.v_head_dim / t
    elif c.multi_latent_attention and context.cp > 1:
        held, inputs, cp_constant = mla_context_bytes(c, w, t, on_gpu, context)
        ad = a * c.v_head_dim / t
    mlp_act = (4 if c.activation in ("swiglu", "quick_geglu") else 2) * w * ffn / t
    common = (2 * norm + 2 * hidden_mask * h) / split + w * h + w * h + w * ad + mlp_act
    layer = common + held + core
    dropped = {"core_attn": held + core - inputs, "mlp": w * h - w * h / split + mlp_act}
    selective = op_layer_bytes(c, w, t, split, kernel) if c.selective_ac_option == "op" \
        else selective_layer_bytes(c, layer, dropped)
    first = 8 * (2 if c.position_embedding_type == "learned_absolute" else 1) + \
        hidden_mask * h / split
    last = norm / split + w * h + 4 * c.padded_vocab_size(tp) / t + 9
    per_layer_constant = float(s * s) if (kernel == "unfused" and not on_gpu) else 0.0
    if context.cp > 1:  # a2a's sequence orders: not kept where the core is recomputed
        per_layer_constant = 0.0 if c.recomputes("core_attn") else cp_constant
    per_chunk = 2 * s * c.rotary_dim * 4.0 / context.cp if rope else 0.0  # local positions
    notes = [f"attention kernel: {kernel}" + (f", context parallel {context.comm_type}"
                                              if context.cp > 1 else "")]
    moe = selective_moe = 0.0
    if c.num_moe_experts is not None:  # the MoE MLP in the dense one's place (w h: its input)
        moe_mlp = moe_mlp_bytes(c, t, ep, t if etp is None else etp)
        shared = c.moe_shared_expert_intermediate_size
        glu = 4 if c.activation in ("swiglu", "quick_geglu") else 2
        swap = moe_mlp - (w * h + mlp_act)
        moe = layer + swap
        selective_moe = selective_layer_bytes(c, moe, {
            "core_attn": dropped["core_attn"], "moe": moe_mlp - w * h / split,
            "shared_experts": 0.0 if c.recomputes("moe") or not shared
            else glu * w * shared / t})
    terms = ActivationTerms(layer, selective, w * h / split, first, last, per_layer_constant,
                            per_chunk, moe, selective_moe, notes)
    return replace(terms, mtp=mtp_bytes(c, terms, norm / split, hidden_mask * h / split,
                                        w * h, 4 * c.padded_vocab_size(tp) / t))


def mtp_bytes(c: "TransformerConfig", terms: ActivationTerms, norm: float, mask: float,
              width_h: float, softmax: float) -> float:
    """Bytes per token the multi-token prediction depths keep on the last stage (models/mtp/
    block.py), each: the rolled token ids (int64; positions too when learned) and their
    embedding's dropout `mask` and norm (`norm`: one norm's), the hidden state's norm,
    eh_proj's 2h input (gathered under sequence parallelism), a transformer layer of the
    last decoder layer's kind (its selective bytes under selective
    recomputation; full recomputation does not checkpoint the depths), the final norm and,
    as the main model's last stage keeps them, the output layer's input (`width_h`), the
    loss's fp32 softmax (`softmax`) and its labels and mask."""
    depth = c.mtp_num_layers or 0
    if not depth:
        return 0.0
    moe = c.num_moe_experts is not None and moe_layer_pattern(c)[-1]
    selective = c.recompute_granularity == "selective"
    layer = (terms.moe_layer_selective if selective else terms.moe_layer) if moe else \
        (terms.layer_selective if selective else terms.layer)
    ids = 8 * (2 if c.position_embedding_type == "learned_absolute" else 1)
    return depth * (ids + mask + 3 * norm + 2 * width_h + layer + width_h + softmax + 9)


def chunk_activations(c: "TransformerConfig", terms: ActivationTerms, layers: int,
                      pre: bool, post: bool, tokens: int,
                      moe: Sequence[bool] = ()) -> Tuple[float, float]:
    """(bytes one micro-batch leaves on a chunk of `layers` layers, the extra short-lived
    bytes when its backward recomputes a block); `moe`: which of them are MoE layers."""
    if any(moe):
        return _moe_chunk_activations(c, terms, list(moe), pre, post, tokens)
    granularity, n = c.recompute_granularity, c.recompute_num_layers or 1
    per_layer = terms.layer * tokens + terms.per_layer_constant
    transient = 0.0
    if granularity == "full" and layers:
        if c.recompute_method == "uniform":
            blocks = -(-layers // n)
            held = blocks * terms.layer_input * tokens
            transient = min(n, layers) * per_layer
        else:  # block: the first n layers are recomputed, the rest keep everything
            recomputed = min(n, layers)
            held = recomputed * terms.layer_input * tokens + (layers - recomputed) * per_layer
            transient = per_layer if recomputed else 0.0
    elif granularity == "selective":
        held = layers * (terms.layer_selective * tokens + terms.per_layer_constant)
        transient = (terms.layer - terms.layer_selective) * tokens if layers else 0.0
    else:
        held = layers * per_layer
    held += terms.per_chunk_constant if layers else 0.0
    held += (terms.first_stage * tokens if pre else 0.0) + \
        ((terms.last_stage + terms.mtp) * tokens if post else 0.0)
    return held, transient


def _moe_chunk_activations(c: "TransformerConfig", terms: ActivationTerms,
                           moe: List[bool], pre: bool, post: bool,
                           tokens: int) -> Tuple[float, float]:
    """`chunk_activations` of a chunk with MoE layers (each layer its own kind's bytes)."""
    granularity, n, layers = c.recompute_granularity, c.recompute_num_layers or 1, len(moe)
    whole = [(terms.moe_layer if m else terms.layer) * tokens + terms.per_layer_constant
             for m in moe]
    transient = 0.0
    if granularity == "full":
        if c.recompute_method == "uniform":
            blocks = [sum(whole[i:i + n]) for i in range(0, layers, n)]
            held, transient = len(blocks) * terms.layer_input * tokens, max(blocks)
        else:
            recomputed = min(n, layers)
            held = recomputed * terms.layer_input * tokens + sum(whole[recomputed:])
            transient = max(whole[:recomputed], default=0.0)
    elif granularity == "selective":
        held = sum((terms.moe_layer_selective if m else terms.layer_selective) * tokens +
                   terms.per_layer_constant for m in moe)
        transient = (terms.layer - terms.layer_selective) * tokens
    else:
        held = sum(whole)
    held += terms.per_chunk_constant + (terms.first_stage * tokens if pre else 0.0) + \
        ((terms.last_stage + terms.mtp) * tokens if post else 0.0)
    return held, transient
