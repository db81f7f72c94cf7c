"""What --optimizer muon adds to a step: Newton-Schulz FLOPs and the extra exchanges.

Read from the model's own parameters (parameters.py's meta models): the whole matrices are
the tp-1 model's (duplicated tp orthogonalises whole matrices; blockwise this rank's shards),
the matrices Muon takes are parallel/zero/muon's rule (2-D weights except the word embedding
and the output layer; a stacked expert weight one matrix per expert; a fused qkv weight split
into its q, k and v rows). Per rank and step on the heaviest pipeline stage:

  FLOPs     every owned matrix's steps x (4 m^2 n + 2 m^3): under ZeRO 1-3 the matrices are
            shared out over the dp x cp ranks (experts: over expert-dp), stage 0 runs all
  exchange  the two all-to-alls of the layer-wise scheme: this rank's shard of the matrices
            out to their owners and the updates back, 2 x 4 bytes x elements x (n-1)/n
  tp        duplicated: the owner gathers each tp-split matrix it owns, 4 bytes x the
            matrix x (tp-1)/tp; distributed: the norm and every step's Gram matrix (the
            unsplit side squared) all-reduced over tp, 2 x 4 bytes x m^2 x (tp-1)/tp a step,
            and each rank's FLOPs 4 m^2 (n/tp) + 2 m^3 a step (m the unsplit side)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

from gigatron.parallel.zero.muon.newton_schulz import newton_schulz_flops
from gigatron.training.plan.memory import expert_data_parallel_size
from gigatron.training.plan.parameters import ParamSpec, stage_parameters

if TYPE_CHECKING:
    from gigatron.training.config.run_config import RunConfig
    from gigatron.training.observe.devices import Hardware

NOT_MATRICES = ("embedding.word_embeddings.weight", "output_layer.weight")
QKV = "linear_qkv.weight"
NS_EFFICIENCY = 0.5
"""Fraction of the bf16 (medium) or fp32 peak Newton-Schulz's small GEMMs sustain (assumed:
bench/bench_muon.py measures the step)."""


def is_matrix(spec: ParamSpec) -> bool:
    """parallel/zero/muon/matrices.py's rule on a planned parameter."""
    return spec.ndim in (2, 3) and spec.kind != "shared_embedding" and \
        not spec.name.endswith(NOT_MATRICES) and \
        not spec.name.rsplit(".", 1)[-1].startswith("bias")  # stacked expert biases


@dataclass(frozen=True)
class MuonCost:
    """One rank's Muon work per step (the heaviest pipeline stage)."""

    flops: float
    exchange_bytes: float
    gather_bytes: float
    seconds: float


def _matrices(spec: ParamSpec, qkv: Optional[Tuple[int, ...]]) -> List[Tuple[int, int]]:
    """The [rows, cols] Newton-Schulz runs on for one parameter."""
    if spec.ndim == 3:
        experts, rows, cols = spec.shape
        return [(rows, cols)] * experts
    rows, cols = spec.shape
    if qkv and spec.name.endswith(QKV) and rows % sum(qkv) == 0:
        groups = rows // sum(qkv)
        return [(groups * r, cols) for r in qkv]
    return [(rows, cols)]


def _distributed(whole: List[ParamSpec], local: List[ParamSpec], qkv, steps: int,
                 tp: int) -> Tuple[float, float]:
    """(FLOPs, all-reduced bytes) of the 'distributed' mode: a split matrix's Gram matrix is
    its unsplit side's square, summed over tp every step."""
    flops = nbytes = 0.0
    for w, s in zip(whole, local):
        for (rows, cols), (r, c) in zip(_matrices(w, qkv), _matrices(s, qkv)):
            if (rows, cols) == (r, c) or tp == 1:
                flops += newton_schulz_flops(r, c, steps)
                continue
            split, other = (r, cols) if r != rows else (c, rows)
            flops += steps * (4 * other * other * split + 2 * other ** 3)
            nbytes += steps * 8.0 * other * other * (tp - 1) / tp
    return flops, nbytes


def _flops(specs: List[ParamSpec], qkv, steps: int) -> float:
    return float(sum(newton_schulz_flops(r, c, steps) for s in specs if is_matrix(s)
                     for r, c in _matrices(s, qkv)))


def muon_cost(run: "RunConfig", hw: "Hardware") -> Optional[MuonCost]:
    """None unless the run's optimizer is Muon."""
    from gigatron.training.plan.planner import partition_of

    z, c, p = run.zero, run.model, run.parallel
    if z.optimizer != "muon" or c is None:
        return None
    config = z.muon
    assert config is not None
    steps, qkv = config.num_ns_steps, config.qkv_split_shapes if config.split_qkv else None
    partition = partition_of(run)
    shards = p.dp * p.context_parallel_size
    edp = expert_data_parallel_size(p.tp, shards, p.ep, p.etp or p.tp)
    share, expert_share = (shards, edp) if z.zero_stage >= 1 else (1, 1)
    worst = MuonCost(0.0, 0.0, 0.0, 0.0)
    for rank in range(p.pp):
        local = [s for chunk in stage_parameters(c, p.tp, partition, rank, p.ep, p.etp)
                 for s in chunk if is_matrix(s)]
        whole = [s for chunk in stage_parameters(c, 1, partition, rank) for s in chunk
                 if is_matrix(s)]
        dense_local = [s for s in local if not s.is_expert]
        expert_local = [s for s in local if s.is_expert]
        reduced = 0.0
        if config.tp_mode == "duplicated":
            dense = _flops([s for s in whole if not s.is_expert], qkv, steps)
            experts = _flops([s for s in whole if s.is_expert], qkv, steps) / p.ep
        elif config.tp_mode == "distributed":
            dense, reduced = _distributed([s for s in whole if not s.is_expert], dense_local,
                                          qkv, steps, p.tp)
            experts, expert_reduced = _distributed([s for s in whole if s.is_expert],
                                                   expert_local, qkv, steps, p.etp or p.tp)
            reduced = reduced / share + expert_reduced / expert_share
        else:
            dense, experts = _flops(dense_local, qkv, steps), _flops(expert_local, qkv, steps)
        flops = dense / share + experts / expert_share
        exchange = sum(8.0 * n * (k - 1) / k / k for n, k in (
            (sum(s.numel for s in dense_local), share),
            (sum(s.numel for s in expert_local), expert_share)) if k > 1)
        gather = reduced
        if config.tp_mode == "duplicated":
            split = [(w.numel, s.numel) for w, s in zip(
                [s for s in whole if not s.is_expert], dense_local) if w.numel > s.numel]
            gather += sum(4.0 * full * (p.tp - 1) / p.tp for full, _ in split) / share
            etp = p.etp or p.tp
            if etp > 1:
                gather += 4.0 * sum(s.numel for s in expert_local) * (etp - 1) / expert_share
        seconds = _seconds(flops, exchange + gather, config.fp32_matmul_prec, hw)
        if seconds >= worst.seconds:
            worst = MuonCost(flops, exchange, gather, seconds)
    return worst


def _seconds(flops: float, nbytes: float, precision: str, hw: "Hardware") -> float:
    peak = hw.peak("bf16" if precision == "medium" else "fp32") or hw.peak("fp32") or 1.0
    link = hw.intra_node_gbps or 100.0
    return flops / (peak * 1e12 * NS_EFFICIENCY) + nbytes / (link * 1e9 * 0.7)
