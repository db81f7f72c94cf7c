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

Context parallelism (../context.py): s/cp tokens per rank, the cp attention's tensors in the
core attention's place (multi-latent attention's at its padded head size: ../mla.py), ZeRO
over dp x cp. Multi-token prediction's depths sit on the last stage (`mtp_bytes`).

state.py        model state per ZeRO stage (exact), the experts' part, the W stash
activations.py  activation bytes per token: layers, MoE, MTP, chunks under recomputation
this module     one rank of each pipeline stage at its schedule's high point
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

from gigatron.models.moe.config_checks import moe_layer_pattern
from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.training.plan.context import NONE, ContextLayout
from gigatron.training.plan.memory.state import (  # noqa: F401 -- the package's API
    ModelStateBytes, expert_data_parallel_size, model_state, model_state_bytes,
    w_stash_bytes)
from gigatron.training.plan.memory.activations import (  # noqa: F401 -- the package's API
    ActivationTerms, activation_terms, attention_kernel, chunk_activations, moe_mlp_bytes,
    mtp_bytes, routed_share)
from gigatron.training.plan.parameters import stage_parameters
from gigatron.training.plan.schedules import peak_held

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.parallel.zero.config import ZeroConfig

GIB = 2 ** 30


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
    state, expert_state = model_state(c, chunks, zero, shards,
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

