"""Step time of a layout: compute, communication and the pipeline bubble, from first principles.

Per micro-batch, each pipeline stage (one tensor-parallel rank of it) spends

  GEMM time         each linear's three GEMMs at the device's measured matmul ceiling
                    (`gemm.gemm_rate`) times their tile and wave quantisation on its SMs,
                    plus the idle gap before each of a layer's kernels; the logits' GEMMs
                    likewise, the cross-entropy at CROSS_ENTROPY_BYTES per logit; a flash
                    attention's core at ATTENTION_EFFICIENCY
  memory time       bytes the element-wise kernels (norms, bias-dropout-add, GeLU/SwiGLU,
                    softmax and dropout of attention, RoPE) read and write / (HBM bandwidth x
                    MEMORY_EFFICIENCY); backward moves twice the forward's bytes
  tensor-parallel   the two all-reduces per layer forward and two backward (all-gather +
  communication     reduce-scatter under sequence parallelism: the same bytes), two more when
                    full recomputation reruns the forward; ring cost 2(t-1)/t x bytes over the
                    node's link (NVLink) x NETWORK_EFFICIENCY. The layers wait on them unless
                    the run overlaps them (--tp-comm-overlap: layer.py, each chunk beside its
                    GEMM, the first one waited for).
  pipeline p2p      the activation sent forward and its gradient sent back, over the link
                    between stages (inter-node once tp x dp fills a node)
  context-parallel  the attention's key/value exchange (context.py) over the link the tp x cp
  communication     ranks span (a2a+p2p: its all-to-all over the tp x A ranks' link); the
                    ring's hops hide behind its blocks' compute, all_gather's and a2a's
                    collectives do not. Each cp rank computes s/cp tokens.

The step is the project's schedule simulator run with the slowest stage's forward and
backward times (so the bubble is the schedule's own, (p-1)/m for 1F1B, (p-1)/3m for zb-h1
with B = W = half the backward), then the data-parallel traffic that the overlaps the run
turns on did not hide (data_parallel.py: --overlap-grad-reduce, --overlap-param-gather,
ZeRO-3's prefetch), then the optimizer step (memory-bound). Recomputation adds to the
backward the forward of what it runs again: the whole layer (full), or the parts of each
--recompute-modules module or of torchtitan's op rule (recompute.py, layer.py). A
collective over nodes gets the NICs of the group's ranks on each node (`_group_link`). An
MoE layer (experts.py) adds its matmuls, bytes and token exchange in its MLP's place;
expert state is reduced over the expert-data-parallel group. The efficiency constants
named below and in gemm.py are measurements (the H200 session's; devices.py's matmul
ceilings), the same for every model and layout (docs/PLAN.md: their values and why;
docs/PERFORMANCE.md: published runs beside the predictions, training/plan/published.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from gigatron.models.attention_kinds import GATED, mean_key_span
from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.training.observe.flops import flops_per_token
from gigatron.training.observe.devices import Hardware
from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.training.plan import context, gemm, layer
from gigatron.training.plan.data_parallel import dp_cost
from gigatron.training.plan.experts import MoELayerCost, moe_layer_cost
from gigatron.training.plan.memory import attention_kernel
from gigatron.training.plan.muon import muon_cost
from gigatron.training.plan.recompute import recomputed_parts
from gigatron.training.plan.schedules import step_makespan

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.training.config.run_config import RunConfig

CROSS_ENTROPY_BYTES = (49, 18)
"""Bytes per logit element the vocab-parallel cross-entropy moves, forward and backward, at
MEMORY_EFFICIENCY of HBM (the fp32 copy, max, subtract, exp, sum, divide; the gradient's
scale and bf16 copy): the H200 session's trace, 14.9 ms forward and 5.4 ms backward over
16384 x 50304 logits (bench/trace_ops.py on trace_gpt3-1.3b.json.gz)."""
MEMORY_EFFICIENCY = 0.57
"""Fraction of HBM bandwidth the element-wise kernels sustain over the bytes `_layer_bytes`
counts: measured on the H200 session (docs/PERFORMANCE.md, "One H200"): its norm, residual,
GeLU, bias-grad, grad-accumulation and grad-norm kernels took 39 ms for the 106 GB the plan
counts for them (2.7 of 4.8 TB/s; a plain copy reached 4.25)."""
ATTENTION_EFFICIENCY = 0.69
"""Fraction of the dense peak a fused (flash) attention kernel sustains, its FLOPs counted
without the causal mask's skipping (4 s^2 a d per layer forward, as `_layer_flops`):
measured on the H200 session (docs/PERFORMANCE.md, "One H200"): cuDNN SDPA took 28.8 ms of
the GPT 1.3B step (24 layers, micro-batch 8, seq 2048: 1.98e13 such FLOPs), 687 TFLOP/s of
989.4. The unfused softmax path runs at `gemm.gemm_rate` (unquantised) with its own bytes."""
FLASH_DROPOUT_SLOWDOWN = (1.93, 1.13)
"""Forward and backward time of the fused attention with dropout over its time without
(--attention-dropout > 0; Megatron's default is 0.1): measured on one H100 SXM, torch's
scaled_dot_product_attention at p = 0.1 and 0, causal, bf16, at the nine per-rank shapes of
the published Megatron-Core rows (bench/bench_plan_kernels.py, bench/results/2026-11-26-h100/
bench_plan_kernels.json): medians of ratios 1.68-2.01 forward and 1.08-1.30 backward."""
NETWORK_EFFICIENCY = 0.7
"""Fraction of a link's datasheet bandwidth NCCL's ring collectives and p2p sends sustain
(nccl-tests' bus bandwidth: ~230 of 300 GB/s NVLink on DGX A100, ~20 of 25 GB/s HDR)."""

OVERLAPS = ("tp-comm", "tp-comm-ag", "tp-comm-rs", "param-gather")
"""The overlaps a plan models, each when the run's flag turns it on (`layer.overlaps_of`) or
`gigatron plan --assume-overlap` asks for it: tp-comm (--tp-comm-overlap: each tp all-gather
and reduce-scatter pipelined in tp chunks with its GEMM; -ag / -rs: only that kind, as
--disable-tp-comm-overlap-rs / -ag leave it) and param-gather (--overlap-param-gather: the
distributed optimizer's all-gather behind the next step's first forward)."""


@dataclass(frozen=True)
class StepCost:
    """Predicted time of one training step and what it is made of (seconds)."""

    forward: float  # one micro-batch on the slowest stage (all its chunks), p2p included
    backward: float  # the same for its backward, recomputation included
    tp_communication: float  # share of forward + backward spent in tp collectives
    pipeline: float  # the simulated schedule: every micro-batch, bubbles included
    bubble: float  # idle over busy time of the simulated schedule
    dp_communication: float  # gradient reduction (+ parameter gathers), all of it
    dp_exposed: float  # the part the backward did not hide
    optimizer: float
    step: float
    tp_bytes: float  # per rank per step
    dp_bytes: float  # per rank per step
    gemm_flops: float  # executed per rank per step (recomputation included)
    expert_communication: float = 0.0  # MoE token exchange per step, slowest stage (exposed)
    expert_bytes: float = 0.0  # its bytes per rank per step
    cp_communication: float = 0.0  # context-parallel traffic per step on the cp link
    cp_exposed: float = 0.0  # the part of it the attention's compute did not hide
    cp_bytes: float = 0.0  # per rank per step


@dataclass(frozen=True)
class Throughput:
    """The step's rates: tokens/s, model TFLOP/s per GPU (PaLM's count), MFU."""

    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float  # what the GPUs execute (recomputation counted)
    mfu: float


def _head_dims(c: "TransformerConfig") -> Tuple[int, int]:
    """(q.k, p.v) channels per head of the attention kernel: the head size, or MLA's
    q/k head (qk_head_dim + qk_pos_emb_head_dim) and its v head, which torch's SDPA path
    (and context parallelism) zero-pads to the q/k head where narrower
    (models/attention/core.py equal_head_dims): the kernel computes the padded width."""
    if not c.multi_latent_attention:
        return c.head_dim, c.head_dim
    q_head = c.qk_head_dim + c.qk_pos_emb_head_dim
    padded = c.attention_backend != "unfused"
    return q_head, max(q_head, c.v_head_dim) if padded else c.v_head_dim


def _layer_flops(c: "TransformerConfig", tokens: int, tp: int) -> Dict[str, float]:
    """Forward matmul FLOPs of one layer on one tp rank: dense (each linear of
    `gemm.named_linears`: MLA's own projections) and attention's core."""
    a = c.num_attention_heads
    dense = sum(2.0 * tokens * k * n for k, n in gemm.named_linears(c, tp).values())
    # QK^T and AV, the causal mask not skipped; sliding windows: their band's keys only
    qk, pv = _head_dims(c)
    core = 2.0 * tokens * mean_key_span(c) * a * (qk + pv) / tp
    return {"dense": dense, "core": core}


def _layer_bytes(c: "TransformerConfig", tokens: int, tp: int, sequence_parallel: bool,
                 on_gpu: bool, cp: int = 1) -> Dict[str, float]:
    """Bytes element-wise kernels move in one layer's forward on one tp rank (under cp the
    attention is always torch's fused kernels)."""
    w = _width(c)
    h, a, ffn, s = c.hidden_size, c.num_attention_heads, c.ffn_hidden_size, c.seq_length
    split = tp if sequence_parallel else 1
    mask = 1 if c.hidden_dropout > 0 else 0
    norms = 2 * 2 * w * h / split
    residual = 2 * (3 * w + mask) * h / split
    activation = (3 if c.activation in GATED else 2) * w * ffn / tp
    rope = 4 * w * h / tp if c.position_embedding_type == "rope" else 0
    if cp > 1 or attention_kernel(c, on_gpu) == "flash":
        qk, pv = _head_dims(c)
        core = 2 * w * a * (qk + pv) / tp  # q, k, v in, output out
    else:  # scores written, softmax read + written, dropout read + written (+ mask), AV read
        core = (6 * w + (1 if c.attention_dropout > 0 else 0)) * a * s / tp
    dense = norms + residual + activation + rope
    return {"dense": dense * tokens, "core": core * tokens, "norms": norms * tokens,
            "residual": residual * tokens, "activation": activation * tokens,
            "rope": rope * tokens}


def _width(c: "TransformerConfig") -> int:
    return c.params_dtype.itemsize


def _dtype_name(c: "TransformerConfig") -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(c.params_dtype, "fp32")


def _all_reduce_time(nbytes: float, ranks: int, gbps: float) -> float:
    if ranks <= 1:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / (gbps * 1e9 * NETWORK_EFFICIENCY)


def _link(extent: int, gpus_per_node: int, hw: Hardware) -> float:
    """Per-device bandwidth of a group whose ranks lie within `extent` consecutive ranks
    (tp varies fastest, then dp, then pp): NVLink if that fits in one node, else the NIC."""
    assert hw.intra_node_gbps is not None and hw.inter_node_gbps is not None
    return hw.intra_node_gbps if extent <= gpus_per_node else hw.inter_node_gbps


def _group_link(size: int, stride: int, hw: Hardware) -> float:
    """Per-device bandwidth of a collective (reduce-scatter, all-gather, all-reduce) over
    `size` ranks `stride` apart (tp-cp-dp-pp order): NVLink within a node; across nodes,
    NCCL's channels spread the ring's node crossings over the NICs of the group's ranks on
    each node (k of them: k x the NIC), up to NVLink. (A point-to-point ring, cp's p2p,
    crosses on one rank's NIC: `_link`.)"""
    assert hw.intra_node_gbps is not None and hw.inter_node_gbps is not None
    if size * stride <= hw.gpus_per_node:
        return hw.intra_node_gbps
    per_node = max(1, min(size, hw.gpus_per_node // stride))
    return min(hw.intra_node_gbps, per_node * hw.inter_node_gbps)


@lru_cache(maxsize=4096)
def _schedule(pp: int, m: int, v: int, forward: float, backward: float,
              schedule: str = "1f1b") -> Tuple[float, float]:
    """(makespan, bubble over busy time) of `schedule` simulated with a chunk's forward and
    backward times (a split backward: half B, half W, as the simulator's default)."""
    makespan = step_makespan(pp, m, v, forward, backward, schedule)
    return makespan, max(0.0, makespan / (m * v * (forward + backward)) - 1.0)


def _moe(run: "RunConfig", hw: Hardware, tokens: int) -> Optional[MoELayerCost]:
    """One MoE layer's extra cost at this layout (None: a dense model)."""
    c, p = run.model, run.parallel
    assert c is not None
    if c.num_moe_experts is None:
        return None
    return moe_layer_cost(c, tokens, p.tp, p.ep, p.etp or p.tp, lambda extent: _link(
        extent, hw.gpus_per_node, hw) * 1e9 * NETWORK_EFFICIENCY)


def _moe_layers(run: "RunConfig", partition: PipelinePartition, r: int) -> int:
    """MoE layers on pipeline rank r (all its chunks)."""
    assert run.model is not None
    pattern = moe_layer_pattern(run.model)
    return sum(pattern[i] for k in range(partition.virtual_chunks)
               for i in partition.layer_range(r, k))


def step_cost(run: "RunConfig", hw: Hardware, partition: PipelinePartition,
              stage_parameters: Sequence[int], on_gpu: bool,
              stage_expert_parameters: Sequence[int] = (),
              assume: FrozenSet[str] = frozenset()) -> StepCost:
    """Predicted step time of `run` on `hw`: every stage's micro-batch times, the slowest
    one run through the schedule simulator (`stage_parameters[r]`: parameters on one rank
    of stage r, `stage_expert_parameters[r]` the routed experts' among them; `assume`:
    overlaps to model as if their flags were given, `OVERLAPS`)."""
    c, p, t = run.model, run.parallel, run.train
    assert c is not None and t.micro_batch_size is not None and hw.hbm_gbps is not None
    peak = hw.peak(_dtype_name(c)) or hw.peak("fp32") or 1.0
    flop_rate = gemm.gemm_rate(hw, _dtype_name(c))
    byte_rate = hw.hbm_gbps * 1e9 * MEMORY_EFFICIENCY
    cp = p.context_parallel_size  # each cp rank computes s/cp tokens of a micro-batch
    tokens, width = c.seq_length * t.micro_batch_size // cp, _width(c)
    sp = p.sequence_parallel and p.tp > 1
    overlaps = layer.overlaps_of(run, assume)
    fl, by = _layer_flops(c, tokens, p.tp), _layer_bytes(c, tokens, p.tp, sp, on_gpu, cp)
    gemm_fwd, gemm_bwd = gemm.linears_seconds(gemm.layer_shapes(c, p.tp), tokens, flop_rate,
                                              hw.sms)
    dense_fwd = gemm_fwd + by["dense"] / byte_rate + gemm.KERNELS_FORWARD * gemm.KERNEL_GAP_S
    dense_bwd = gemm_bwd + 2 * by["dense"] / byte_rate + \
        gemm.KERNELS_BACKWARD * gemm.KERNEL_GAP_S
    flash = cp > 1 or attention_kernel(c, on_gpu) == "flash"
    core_fwd, core_bwd = _core_seconds(fl["core"], by["core"], flash, c.attention_dropout > 0,
                                       flop_rate, peak * 1e12 * ATTENTION_EFFICIENCY, byte_rate)
    vocab = c.padded_vocab_size(p.tp) // p.tp
    logits_fwd, logits_bwd = gemm.linears_seconds(((c.hidden_size, vocab),), tokens,
                                                  flop_rate, hw.sms)
    logits_fwd += tokens * vocab * CROSS_ENTROPY_BYTES[0] / byte_rate
    logits_bwd += tokens * vocab * CROSS_ENTROPY_BYTES[1] / byte_rate
    one_collective = _all_reduce_time(tokens * c.hidden_size * width, p.tp,
                                      _link(p.tp, hw.gpus_per_node, hw))
    recompute = c.recompute_granularity or ""
    full = recompute == "full"
    moe = _moe(run, hw, tokens)
    parts = layer.layer_parts(c, p.tp, sp, hw.sms, tokens, (flop_rate, byte_rate), by,
                              (core_fwd, core_bwd, fl["core"]), one_collective,
                              layer.tp_overlap(overlaps), moe)
    # what a selective recomputation runs again in each kind of layer (recompute.py)
    again = layer.recomputed(parts, recomputed_parts(c, False, flash))
    tp_again = layer.recomputed(parts, [n for n in recomputed_parts(c, False, flash)
                                        if n.startswith("tp_")]).forward
    again_moe = layer.recomputed(parts, recomputed_parts(c, True, flash))
    collectives_fwd, collectives_bwd = 2, 2 + (2 if full else 0)
    p2p = 0.0
    if p.pp > 1:
        pp_link = _link(p.tp * cp * p.dp * p.pp, hw.gpus_per_node, hw)
        p2p = tokens * c.hidden_size * width / (p.tp if sp else 1) / \
            (pp_link * 1e9 * NETWORK_EFFICIENCY)
    cp_traffic = context.layer_traffic(run, tokens, core_fwd, lambda extent: _link(
        extent, hw.gpus_per_node, hw) * 1e9 * NETWORK_EFFICIENCY)
    tp_fwd = parts["tp_attention"].forward + parts["tp_mlp"].forward
    tp_bwd = parts["tp_attention"].backward + parts["tp_mlp"].backward + \
        (tp_fwd if full else 0.0)
    layer_fwd = dense_fwd + core_fwd + tp_fwd + cp_traffic["fwd_s"]
    layer_bwd = dense_bwd + core_bwd + tp_bwd + \
        (dense_fwd + core_fwd if full else again.forward) + cp_traffic["bwd_s"]
    moe_fwd = moe_bwd = 0.0
    if moe is not None:  # an MoE layer beyond a dense one: compute, tp collectives, exchange
        moe_fwd = parts["moe"].forward
        moe_bwd = parts["moe"].backward + (moe_fwd if full else
                                           again_moe.forward - again.forward)
    mtp = _mtp(c, p.tp, tokens, (flop_rate, hw.sms), full, parts, (again, again_moe),
               (layer_fwd, moe_fwd, logits_fwd, logits_bwd, cp_traffic["bwd_s"]), fl)
    v = partition.virtual_chunks
    forward = backward = 0.0
    slowest = 0
    for r in range(p.pp):
        layers = sum(len(partition.layer_range(r, k)) for k in range(v))
        last = partition.post_process(r, v - 1)
        f = layers * layer_fwd + (logits_fwd + mtp[0] if last else 0.0) + v * p2p
        b = layers * layer_bwd + (logits_bwd + mtp[1] if last else 0.0) + v * p2p
        if moe is not None:
            f, b = f + _moe_layers(run, partition, r) * moe_fwd, \
                b + _moe_layers(run, partition, r) * moe_bwd
        if f + b > forward + backward:
            forward, backward, slowest = f, b, r
    m = t.num_microbatches
    makespan, bubble = _schedule(p.pp, m, v, forward / v, backward / v, p.pipeline_schedule)
    heaviest = max(range(len(stage_parameters)), key=stage_parameters.__getitem__)
    layers = sum(len(partition.layer_range(slowest, k)) for k in range(v))
    dp = dp_cost(run, stage_parameters[heaviest], hw, m, (forward, backward), byte_rate,
                 stage_expert_parameters[heaviest] if stage_expert_parameters else 0,
                 "param-gather" in overlaps, layers + 1)
    collectives: float = layers * (collectives_fwd + collectives_bwd + again.collectives)
    executed = layers * (3 * (fl["dense"] + fl["core"]) + (
        fl["dense"] + fl["core"] if full else again.flops)) + \
        (3 * 2.0 * tokens * c.hidden_size * vocab + mtp[2]
         if partition.post_process(slowest, v - 1) else 0.0)
    tp_waited = layers * (tp_fwd + tp_bwd + tp_again)
    expert_s = expert_bytes = 0.0
    if moe is not None:
        moe_layers = _moe_layers(run, partition, slowest)
        collectives += moe_layers * (moe.tp_collectives * (2 + 2 * full) +
                                     again_moe.collectives - again.collectives)
        executed += moe_layers * ((3 + full) * moe.flops + again_moe.flops - again.flops)
        expert_s = m * moe_layers * (moe.exchange_forward_s * (1 + full) +
                                     moe.exchange_backward_s)
        expert_bytes = m * moe_layers * (moe.exchange_forward_bytes * (1 + full) +
                                         moe.exchange_backward_bytes)
        tp_waited += moe_layers * moe.tp_collectives * (2 + 2 * full) * one_collective
    tp_bytes = m * collectives * 2.0 * (p.tp - 1) / p.tp * tokens * c.hidden_size * width
    muon = muon_cost(run, hw)  # Newton-Schulz and its exchanges are part of the step
    optimizer = dp["optimizer"] + (muon.seconds if muon is not None else 0.0)
    return StepCost(forward, backward, tp_waited if any(layer.tp_overlap(overlaps)) else
                    collectives * one_collective, makespan, bubble,
                    dp["total"], dp["exposed"], optimizer,
                    makespan + dp["exposed"] + optimizer, tp_bytes,
                    dp["bytes"], m * executed, expert_s, expert_bytes,
                    m * layers * cp_traffic["step_s"], m * layers * cp_traffic["exposed_s"],
                    m * layers * cp_traffic["bytes"])


def _mtp(c: "TransformerConfig", tp: int, tokens: int, rate: Tuple[float, Optional[int]],
         full: bool, parts: Dict[str, layer.Part], again: Tuple[layer.Part, layer.Part],
         times: Tuple[float, float, float, float, float], fl: Dict[str, float]
         ) -> Tuple[float, float, float]:
    """(forward, backward seconds, executed FLOPs) the multi-token prediction depths add to
    the last stage's micro-batch (models/mtp/block.py): each a transformer layer of the last
    decoder layer's kind (full recomputation does not checkpoint it; a selective one runs
    its modules again), eh_proj's 2h -> h GEMMs and another pass through the logits;
    `times`: a dense layer's forward, an MoE layer's beyond it, the logits' forward and
    backward, the cp exchange's backward."""
    depth = c.mtp_num_layers or 0
    if not depth:
        return 0.0, 0.0, 0.0
    layer_fwd, moe_fwd, logits_fwd, logits_bwd, cp_bwd = times
    moe = c.num_moe_experts is not None and moe_layer_pattern(c)[-1]
    rerun = again[1] if moe else again[0]
    eh = (2 * c.hidden_size, c.hidden_size // tp)
    eh_fwd, eh_bwd = gemm.linears_seconds((eh,), tokens, rate[0], rate[1])
    backward = sum(q.backward for name, q in parts.items() if name not in (
        "moe", "shared_experts") or (moe and name == "moe")) + cp_bwd + \
        (0.0 if full else rerun.forward)
    flops = 3 * (fl["dense"] + fl["core"] + (parts["moe"].flops if moe else 0.0) +
                 2.0 * tokens * eh[0] * eh[1] + 2.0 * tokens * c.hidden_size *
                 c.padded_vocab_size(tp) / tp) + (0.0 if full else rerun.flops)
    return (depth * (layer_fwd + (moe_fwd if moe else 0.0) + eh_fwd + logits_fwd),
            depth * (backward + eh_bwd + logits_bwd), depth * flops)


def _core_seconds(flops: float, nbytes: float, flash: bool, dropout: bool, flop_rate: float,
                  flash_rate: float, byte_rate: float) -> Tuple[float, float]:
    """(forward, backward) seconds of attention's core in one layer: the fused kernel at
    `flash_rate` (slower with dropout: FLASH_DROPOUT_SLOWDOWN), else the unfused matmuls at
    `flop_rate`; the backward does twice the forward's work."""
    compute = flops / (flash_rate if flash else flop_rate)
    forward, backward = FLASH_DROPOUT_SLOWDOWN if flash and dropout else (1.0, 1.0)
    return compute * forward + nbytes / byte_rate, 2 * (compute * backward + nbytes / byte_rate)


def throughput(run: "RunConfig", cost: StepCost, hw: Hardware) -> Throughput:
    """Rates of the predicted step: PaLM-convention model FLOPs (training/observe/flops.py)
    for MFU."""
    c, p, t = run.model, run.parallel, run.train
    assert c is not None and t.global_batch_size is not None
    tokens = t.global_batch_size * c.seq_length
    model = flops_per_token(c, p.tp) * tokens / cost.step / p.world_size / 1e12
    peak = hw.peak(_dtype_name(c)) or hw.peak("fp32") or 1.0
    hardware_flops = cost.gemm_flops / cost.step / 1e12
    return Throughput(tokens / cost.step, model, hardware_flops, model / peak)
