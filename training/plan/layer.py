"""One transformer layer's forward on one rank, part by part: what a selective recomputation
runs again (recompute.py names the parts of each module) and what --tp-comm-overlap hides.

The parts of a layer (`Part`: forward and backward seconds, forward matmul FLOPs, tensor-
parallel collectives in all-reduce equivalents per pass):
  each linear of gemm.named_linears  its GEMMs (tile and wave quantised)
  norms, residual, activation, rope  element-wise bytes at cost.MEMORY_EFFICIENCY of HBM
                                     (residual: bias-dropout-add)
  core                               the attention's core kernel
  gaps                               the idle gap before each of the layer's kernels
  tp_attention, tp_mlp               the collectives around the attention's and the MLP's
                                     linears (sequence parallel: all-gather before the
                                     column-parallel linear, reduce-scatter after the row-
                                     parallel one, the reverse in backward; else an all-
                                     reduce after each and of the input gradient)
MoE layers add `moe` (the MoE MLP beyond the dense one: experts.py's terms) and
`shared_experts`.

Overlap (one rule for every overlap the plan models: `exposed`): a collective split in
pieces, each piece issued behind the compute beside it, waits for its first piece and for
what the compute does not cover. --tp-comm-overlap (sequence parallelism only, as Megatron-
Core requires; parallel/tensor/async_tp.py runs it) splits each all-gather and reduce-
scatter in tp chunks, each chunk's transfer beside the neighbouring chunk's GEMM: the first
chunk (1/tp) is exposed, the other (tp-1)/tp hides behind the (tp-1)/tp of the GEMM they
pair with (forward: the linear's forward GEMM; backward: its dgrad GEMM, half its backward),
the excess exposed. Without the flag every collective is waited for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, FrozenSet, Iterable, Optional, Set, Tuple

from gigatron.models.attention_kinds import GATED
from gigatron.training.plan import gemm

if TYPE_CHECKING:
    from gigatron.models.config import TransformerConfig
    from gigatron.training.config.run_config import RunConfig
    from gigatron.training.plan.experts import MoELayerCost

ATTENTION_INPUTS = ("linear_qkv", "linear_q_proj", "linear_q_down_proj", "linear_kv_down_proj")
"""The linears that read the layer's (gathered) input on the attention's side."""


@dataclass(frozen=True)
class Part:
    """One part of a layer's micro-batch on one rank."""

    forward: float  # seconds
    backward: float  # seconds (recomputation not included)
    flops: float = 0.0  # forward matmul FLOPs
    collectives: float = 0.0  # tp collectives per pass, in all-reduce equivalents


def exposed(comm: float, first: float, compute: float) -> float:
    """Seconds a collective of `comm` seconds is waited for when it is split in pieces, the
    first (fraction `first` of it) waited for and the rest issued behind `compute` seconds
    of work: first x comm + max(0, the rest - compute), written as max(first x comm,
    comm - compute) (the same; no compute: comm itself)."""
    return max(first * comm, comm - compute)


def tp_parts(gemms: Dict[str, Tuple[float, float]], one_collective: float, tp: int,
             sequence_parallel: bool, overlap: Tuple[bool, bool]) -> Dict[str, Part]:
    """The two tp collective parts (`tp_attention`, `tp_mlp`) as waited for: each is two
    halves of an all-reduce's time (under sequence parallelism an all-gather before the
    column-parallel linear and a reduce-scatter after the row-parallel one; in backward a
    reduce-scatter of the column-parallel dgrad and an all-gather before the row-parallel
    dgrad), each half beside its linear's GEMM (`gemms[name]`: forward and backward seconds,
    the dgrad half of the backward) when `overlap` (all-gathers, reduce-scatters) pipelines
    it (--tp-comm-overlap; --disable-tp-comm-overlap-ag / -rs keep one kind whole)."""
    if tp == 1:
        return {"tp_attention": Part(0.0, 0.0, 0.0, 1.0), "tp_mlp": Part(0.0, 0.0, 0.0, 1.0)}
    half = one_collective / 2

    def wait(beside: Iterable[str], backward: bool, gather: bool) -> float:
        if not (sequence_parallel and overlap[0 if gather else 1]):
            return half
        compute = sum(gemms[name][1] / 2 if backward else gemms[name][0]
                      for name in beside if name in gemms)
        return exposed(half, 1.0 / tp, (tp - 1) / tp * compute)

    out = {}
    for part, (inputs, output) in (("tp_attention", (ATTENTION_INPUTS, ("linear_proj",))),
                                   ("tp_mlp", (("linear_fc1",), ("linear_fc2",)))):
        out[part] = Part(wait(inputs, False, True) + wait(output, False, False),
                         wait(inputs, True, False) + wait(output, True, True), 0.0, 1.0)
    return out


def recomputed(parts: Dict[str, Part], names: Iterable[str]) -> Part:
    """The forward of `names` run again in the backward: its seconds (as a Part's forward),
    FLOPs and collectives."""
    chosen = [parts[name] for name in dict.fromkeys(names) if name in parts]
    return Part(sum(p.forward for p in chosen), 0.0, sum(p.flops for p in chosen),
                sum(p.collectives for p in chosen))


def overlaps_of(run: "RunConfig", assume: FrozenSet[str] = frozenset()) -> FrozenSet[str]:
    """The overlaps (cost.OVERLAPS) the run's flags turn on, with those `assume` adds:
    tp-comm (--tp-comm-overlap under sequence parallelism; tp-comm-ag / tp-comm-rs when
    --disable-tp-comm-overlap-rs / -ag keep the other kind whole) and param-gather
    (--overlap-param-gather)."""
    from gigatron.training.plan.data_parallel import overlaps_param_gather

    tp_comm = getattr(run.settings, "tp_comm", None)
    flags: Set[str] = set()
    if getattr(tp_comm, "tp_comm_overlap", False) and run.parallel.sequence_parallel:
        ag, rs = not getattr(tp_comm, "no_tp_comm_overlap_ag", False), \
            not getattr(tp_comm, "no_tp_comm_overlap_rs", False)
        flags |= {"tp-comm"} if ag and rs else {"tp-comm-ag"} if ag else \
            {"tp-comm-rs"} if rs else set()
    if overlaps_param_gather(run):
        flags.add("param-gather")
    return frozenset(flags) | assume


def tp_overlap(overlaps: FrozenSet[str]) -> Tuple[bool, bool]:
    """(all-gathers, reduce-scatters) --tp-comm-overlap pipelines, of `overlaps_of`'s set."""
    both = "tp-comm" in overlaps
    return both or "tp-comm-ag" in overlaps, both or "tp-comm-rs" in overlaps


def layer_parts(c: "TransformerConfig", tp: int, sequence_parallel: bool, sms: Optional[int],
                tokens: int, rates: Tuple[float, float], nbytes: Dict[str, float],
                core: Tuple[float, float, float], one_collective: float,
                overlap: Tuple[bool, bool], moe: Optional["MoELayerCost"]) -> Dict[str, Part]:
    """One layer's parts (module docstring) on one rank for a micro-batch of `tokens`;
    `rates`: FLOP/s of a full GEMM wave and bytes/s of the element-wise kernels; `nbytes`:
    cost._layer_bytes'; `core`: the attention core's forward and backward seconds and
    FLOPs; `overlap`: `tp_overlap`'s; `moe`: an MoE layer's terms beyond a dense one."""
    flop_rate, byte_rate = rates
    parts: Dict[str, Part] = {}
    for name, (k, n) in gemm.named_linears(c, tp).items():
        fwd, bwd = gemm.linears_seconds(((k, n),), tokens, flop_rate, sms)
        parts[name] = Part(fwd, bwd, 2.0 * tokens * k * n)
    for name in ("norms", "residual", "activation", "rope"):
        parts[name] = Part(nbytes[name] / byte_rate, 2 * nbytes[name] / byte_rate)
    parts["core"] = Part(*core)
    parts["gaps"] = Part(gemm.KERNELS_FORWARD * gemm.KERNEL_GAP_S,
                         gemm.KERNELS_BACKWARD * gemm.KERNEL_GAP_S)
    parts.update(tp_parts({n: (q.forward, q.backward) for n, q in parts.items()},
                          one_collective, tp, sequence_parallel, overlap))
    if moe is not None:  # beyond a dense layer, the dense MLP's collective as waited for
        extra = moe.flops / flop_rate + moe.element_bytes / byte_rate
        collectives = moe.tp_collectives * one_collective
        parts["moe"] = Part(
            extra + collectives + (one_collective - parts["tp_mlp"].forward) +
            moe.exchange_forward_s, 2 * extra + collectives +
            (one_collective - parts["tp_mlp"].backward) + moe.exchange_backward_s,
            moe.flops, moe.tp_collectives)
        shared = c.moe_shared_expert_intermediate_size or 0
        if shared:  # fc1 (gated: twice as wide) and fc2, the activation, their collective
            glu = 3 if c.activation in GATED else 2
            flops = 2.0 * tokens * c.hidden_size * shared * glu / tp
            seconds = flops / flop_rate + \
                glu * c.params_dtype.itemsize * shared / tp * tokens / byte_rate + \
                one_collective
            parts["shared_experts"] = Part(seconds, 2 * seconds, flops, 1.0)
    return parts
