"""Memory of one rank of each pipeline stage: model state exactly, activations by formula.

Model state (parameters, gradients, fp32 master weights, optimizer moments) is laid
out as `gigatron.parallel.zero` lays it out: the same flat groups, the same buckets padded
to a multiple of the data-parallel size (`plan_buckets`), the same master-aliasing rule, so
the bytes equal what `measure_memory` reports after a step (tests/test_plan_memory.py).

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (section 4): per layer and micro-batch s*b*h*(34 + 5*a*s/h) bytes at
2-byte activations and 1-byte dropout masks, divided by t where tensor (and, with
--sequence-parallel, sequence) parallelism splits a tensor; selective recomputation drops
the 5as/h term; full recomputation keeps each recomputed block's input. `activation_terms`
writes that count tensor by tensor for this implementation (which tensors autograd keeps:
the activation dtype, fp32 norm statistics, the attention kernel actually taken, what
sequence parallelism gathers), so it is the paper's formula where the implementation is
the paper's, and this code's where it differs. The first pipeline stage holds the
micro-batches its schedule has in flight, read from the schedule itself (1F1B: p; interleaved:
Megatron's (p - 1) * 2 + (v - 1) * p + 1 chunk forwards), each until its backward.
A split backward (zb-h1, zbv) frees them at B and keeps a W stash until W (`w_stash_bytes`,
Qi et al.'s 32sbh per layer; recomputation does not shrink it): zb-h1's stage r holds 1F1B's
p - r micro-batches plus r stashes (at pp 2 the last stage nearly twice its 1F1B bytes).

Mixture of experts (`moe_mlp_bytes`): an MoE layer keeps, instead of the dense MLP's, its
router's tensors (tokens x E), the dispatched rows (tokens x topk x h), the experts' fc1
output and activation (tokens x topk x (2)f / etp), the expert outputs weighted by the
router, and the shared experts' dense MLP. Expert state is ZeRO-sharded over the
expert-data-parallel group (edp = tp x dp / (etp x ep)), the rest over dp.

Context parallelism (context.py): s/cp tokens per rank, the cp attention's tensors in the
core attention's place (multi-latent attention's at its padded head size: mla.py), ZeRO over
dp x cp. Multi-token prediction's depths sit on the last stage (`mtp_bytes`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

import torch

from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.training.plan.schedules import peak_held
from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.parallel.zero.layout import group_sizes, plan_buckets
from gigatron.training.plan.context import NONE, ContextLayout, attention_held
from gigatron.training.plan.mla import mla_attention_bytes, mla_context_bytes
from gigatron.training.plan.parameters import ParamSpec, is_expert_parallel, stage_parameters
from gigatron.training.plan.recompute import op_layer_bytes, selective_layer_bytes

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.parallel.zero.config import ZeroConfig

GIB = 2 ** 30


@dataclass(frozen=True)
class ModelStateBytes:
    """What ZeRO holds on one rank (the fields of `measure_memory`), and where."""

    params: int
    grads: int
    master_params: int
    optimizer_state: int
    offloaded: bool = False  # master weights and optimizer state live in host memory

    @property
    def device(self) -> int:
        return self.params + self.grads + (0 if self.offloaded else self.host_side)

    @property
    def host_side(self) -> int:
        return self.master_params + self.optimizer_state


@dataclass(frozen=True)
class StageMemory:
    """One rank of pipeline stage `pp_rank`: its parameters and memory by kind."""

    pp_rank: int
    parameters: int  # this tp rank's parameters on this stage (all its chunks)
    state: ModelStateBytes
    activations: float  # held at the schedule's high point (see module docstring)
    in_flight: List[int]  # micro-batches per chunk held at that point
    transient: float  # largest short-lived buffer on top (recompute, logits grad, bucket)
    expert_parameters: int = 0  # of `parameters`: this rank's share of the routed experts
    expert_state: Optional[ModelStateBytes] = None  # of `state`: theirs, sharded over edp
    # micro-batches per chunk whose W stash is held at that point (split backward only)
    w_stash: List[int] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return self.state.device + self.activations + self.transient


def _width(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---- model state ------------------------------------------------------------------------

def _ordered(chunks: List[List[ParamSpec]], stage: int) -> Tuple[List[List[ParamSpec]],
                                                                Optional[Dict[str, int]]]:
    """ZeroOptimizer._build_groups' order: reversed registration per chunk; stage 3: the
    gather units (each layer, then the rest) of its single chunk."""
    if stage < 3:
        return [specs[::-1] for specs in chunks], None
    (specs,) = chunks
    unit_of: Dict[str, int] = {}
    layers = [s for s in specs if s.name.startswith("decoder.layers.")]
    for s in layers:
        unit_of[s.name] = int(s.name.split(".")[2])
    rest = [s for s in specs if s.name not in unit_of]
    for s in rest:
        unit_of[s.name] = -1
    order = {index: n for n, index in enumerate(dict.fromkeys(unit_of[s.name]
                                                              for s in layers))}
    order[-1] = len(order)
    unit_ids = {name: order[u] for name, u in unit_of.items()}
    return [layers + rest], unit_ids


def model_state_bytes(chunks: List[List[ParamSpec]], zero: "ZeroConfig", dp: int,
                      params_dtype: torch.dtype, offload_to_host: bool) -> ModelStateBytes:
    """Bytes of one rank's ZeRO buffers for these chunks' parameters (`offload_to_host`:
    the master weights live on another device than the parameters, i.e. optimizer offload
    on a GPU)."""
    from gigatron.training.plan.muon import is_matrix

    stage, width = zero.zero_stage, _width(params_dtype)
    ordered, unit_ids = _ordered(chunks, stage)
    params = grads = master = state = 0
    per_element_state = 8 if zero.optimizer in ("adam", "adamw", "muon") else \
        (4 if zero.sgd_momentum else 0)
    for specs in ordered:
        # Muon: its matrices (a momentum, 4 bytes) in flat groups apart from AdamW's tensors
        keyed: Dict[Tuple[str, bool, bool], List[ParamSpec]] = {}
        for s in specs:
            keyed.setdefault((s.kind, s.ndim >= 2, zero.optimizer == "muon" and is_matrix(s)),
                             []).append(s)
        for (kind, _, matrices), group in sorted(keyed.items()):
            bucket_size = 1 if kind == "shared_embedding" else zero.reduce_bucket_size
            buckets = plan_buckets([s.numel for s in group], bucket_size,
                                   dp if stage >= 1 else 1,
                                   None if unit_ids is None else [unit_ids[s.name]
                                                                  for s in group])
            full, shard = group_sizes(buckets)
            params += (shard if stage == 3 else full) * width
            grads += (full if stage <= 1 else shard) * zero.reduce_dtype.itemsize
            aliases = width == 4 and not offload_to_host and \
                (stage in (0, 3) or len(buckets) == 1)
            master += 0 if aliases else shard * 4
            state += shard * (4 if matrices else per_element_state)
    return ModelStateBytes(params, grads, master, state, offloaded=offload_to_host)


def _plus(a: ModelStateBytes, b: ModelStateBytes) -> ModelStateBytes:
    return ModelStateBytes(a.params + b.params, a.grads + b.grads,
                           a.master_params + b.master_params,
                           a.optimizer_state + b.optimizer_state, a.offloaded)


def expert_data_parallel_size(tp: int, dp: int, ep: int, etp: int) -> int:
    """edp: the ranks of a pipeline stage holding the same experts (Megatron-Core's)."""
    if (tp * dp) % (etp * ep):
        raise ValueError(f"--expert-tensor-parallel-size {etp} x --expert-model-parallel-size "
                         f"{ep} does not divide tensor x data parallel = {tp} x {dp}")
    return tp * dp // (etp * ep)


# ---- activations ------------------------------------------------------------------------

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
    w, h, e, k = _width(c.params_dtype), c.hidden_size, c.num_moe_experts, c.moe_router_topk
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
    w = _width(c.params_dtype)
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


def w_stash_bytes(specs: Sequence[ParamSpec], dtype: torch.dtype) -> float:
    """Bytes per token of a chunk's W stash: each deferred linear's input and output
    gradient (parallel/tensor/wgrad.py), as wide as this rank's weight (column-parallel: in,
    gathered under sequence parallelism, and out/tp; row-parallel: in/tp and out)."""
    return _width(dtype) * sum(s.shape[0] + s.shape[1] for s in specs if s.deferrable)


def _model_state(c: "TransformerConfig", chunks: List[List[ParamSpec]], zero: "ZeroConfig",
                 dp: int, edp: int, offload: bool) -> Tuple[ModelStateBytes,
                                                            Optional[ModelStateBytes]]:
    """(all of one rank's ZeRO state, the routed experts' part of it): expert-parallel
    weights (kind 'expert') are sharded over edp in flat groups of their own, the rest over
    dp (replicated experts too, as the trainer reduces them)."""
    if not any(s.is_expert for specs in chunks for s in specs):
        return model_state_bytes(chunks, zero, dp, c.params_dtype, offload), None
    experts = [[s for s in specs if s.kind == "expert"] for specs in chunks]
    if not any(experts):  # experts replicated over tp: their state as the dense state's
        part = [[s for s in specs if s.is_expert] for specs in chunks]
        return model_state_bytes(chunks, zero, dp, c.params_dtype, offload), \
            model_state_bytes(part, zero, dp, c.params_dtype, offload)
    dense = [[s for s in specs if s.kind != "expert"] for specs in chunks]
    expert_state = model_state_bytes(experts, zero, edp, c.params_dtype, offload)
    return _plus(model_state_bytes(dense, zero, dp, c.params_dtype, offload),
                 expert_state), expert_state


def stage_memory(c: "TransformerConfig", partition: PipelinePartition, pp_rank: int, tp: int,
                 dp: int, zero: "ZeroConfig", micro_batch_size: int, num_microbatches: int,
                 on_gpu: bool, ep: int = 1, etp: Optional[int] = None,
                 context: ContextLayout = NONE, schedule: str = "1f1b",
                 memo: Optional[Dict[tuple, tuple]] = None,
                 terms: Optional[ActivationTerms] = None) -> StageMemory:
    """Memory of one rank of pipeline stage `pp_rank` (any tp/dp/cp rank: all hold the
    same; ep, etp: the expert layers' sizes, etp None: tp; `context`: cp ranks share the
    model, so ZeRO shards over dp x cp, and hold s/cp tokens; `schedule`: its name;
    `memo`: the stages' model state kept by layout sizes, for layouts of one model only:
    `search`'s; `terms`: `activation_terms` of these sizes, when already known)."""
    etp, shards = tp if etp is None else etp, dp * context.cp
    key = (tp, pp_rank, partition.pp_size, partition.virtual_chunks, partition.placement,
           partition.layers[pp_rank], ep, etp, shards, repr(zero), on_gpu)
    held_state = None if memo is None else memo.get(key)
    if held_state is None:
        held_state = _stage_state(c, partition, pp_rank, tp, shards, zero, on_gpu, ep, etp)
        if memo is not None:
            memo[key] = held_state
    chunks, state, expert_state, stash_per_token, parameters, expert_parameters = held_state
    terms = activation_terms(c, tp, on_gpu, ep, etp, context) if terms is None else terms
    tokens = c.seq_length * micro_batch_size // context.cp
    pattern = moe_layer_pattern(c)
    per_chunk = [chunk_activations(c, terms, len(partition.layer_range(pp_rank, k)),
                                   partition.pre_process(pp_rank, k),
                                   partition.post_process(pp_rank, k), tokens,
                                   [pattern[i] for i in partition.layer_range(pp_rank, k)])
                 for k in range(partition.virtual_chunks)]
    held, in_flight, w_stash = peak_held(
        pp_rank, partition.pp_size, num_microbatches, partition.virtual_chunks, schedule,
        [bytes_ for bytes_, _ in per_chunk],
        [per_token * tokens for per_token in stash_per_token])
    transient = max(t for _, t in per_chunk)
    if any(partition.post_process(pp_rank, k) for k in range(partition.virtual_chunks)):
        # the loss's backward: the fp32 gradient of the logits beside the saved softmax
        transient = max(transient, 4.0 * tokens * c.padded_vocab_size(tp) / tp *
                        (1 + (c.mtp_num_layers or 0)))
    return StageMemory(pp_rank, parameters, state, held, in_flight, transient,
                       expert_parameters, expert_state, w_stash)


def _stage_state(c: "TransformerConfig", partition: PipelinePartition, pp_rank: int, tp: int,
                 shards: int, zero: "ZeroConfig", on_gpu: bool, ep: int, etp: int) -> tuple:
    """What a stage's parameters decide, whatever the micro-batches and recomputation:
    (chunks' parameters, ZeRO state, its experts' part, each chunk's W stash per token,
    parameters, expert parameters)."""
    chunks = stage_parameters(c, tp, partition, pp_rank, ep, etp)
    state, expert_state = _model_state(c, chunks, zero, shards,
                                       expert_data_parallel_size(tp, shards, ep, etp),
                                       on_gpu and zero.offload_optimizer == "cpu")
    return (chunks, state, expert_state,
            [w_stash_bytes(specs, c.params_dtype) for specs in chunks],
            sum(s.numel for specs in chunks for s in specs),
            sum(s.numel for specs in chunks for s in specs if s.is_expert))


def plan_memory(c: "TransformerConfig", partition: PipelinePartition, tp: int, dp: int,
                zero: "ZeroConfig", micro_batch_size: int, num_microbatches: int,
                on_gpu: bool, ep: int = 1, etp: Optional[int] = None,
                context: ContextLayout = NONE, schedule: str = "1f1b",
                memo: Optional[Dict[tuple, tuple]] = None) -> List[StageMemory]:
    """`stage_memory` of every pipeline stage (the same activation terms on each)."""
    terms = activation_terms(c, tp, on_gpu, ep, tp if etp is None else etp, context)
    return [stage_memory(c, partition, r, tp, dp, zero, micro_batch_size, num_microbatches,
                         on_gpu, ep, etp, context, schedule, memo, terms)
            for r in range(partition.pp_size)]

