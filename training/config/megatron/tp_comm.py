"""Megatron's --tp-comm-overlap and its family -> the overlapped tensor-parallel linears.

Megatron-Core hands these flags to Transformer Engine's userbuffers, which split the
sequence-parallel all-gathers and reduce-scatters of the transformer layers' linears into
chunks exchanged under the GEMMs. gigatron does the same with rings of asynchronous
send/recv chunks (`gigatron.parallel.tensor.async_tp`, docs/PERFORMANCE.md): the same layers
(linear_qkv, linear_proj, linear_fc1, linear_fc2; not the embedding or the output layer), the
same numbers up to the order of the tp-way sums. The all-gather and reduce-scatter halves
follow --disable-tp-comm-overlap-ag / -rs; the other knobs choose among Transformer Engine's
kernels (bulk or split overlap, atomic GEMMs, the userbuffers' bootstrap and YAML) and are
accepted with what runs here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.parallel.tensor.async_tp import TPCommOverlap
    from gigatron.training.config.table import Settings

_ACCEPTED = "accepted without effect (the same numbers): "


@dataclass(frozen=True)
class TPCommSettings:
    """Tensor-parallel communication overlapped with the GEMMs (docs/PERFORMANCE.md)."""

    tp_comm_overlap: bool = setting(
        False, "overlap the transformer layers' sequence-parallel all-gathers and "
        "reduce-scatters with their GEMMs: each split into tp chunks passed round a ring of "
        "async send/recv while the chunk before is multiplied, forward and backward (needs "
        "--sequence-parallel, as in Megatron; not with --fp8-format)", "--tp-comm-overlap")
    no_tp_comm_overlap_ag: bool = setting(
        False, "with --tp-comm-overlap: run the all-gathers (column-parallel forward, "
        "row-parallel dgrad) as one collective, not chunked under the GEMM",
        "--no-tp-comm-overlap-ag", "--disable-tp-comm-overlap-ag")
    no_tp_comm_overlap_rs: bool = setting(
        False, "with --tp-comm-overlap: run the reduce-scatters (row-parallel forward, "
        "column-parallel dgrad) as one collective, not chunked under the GEMM",
        "--no-tp-comm-overlap-rs", "--disable-tp-comm-overlap-rs")
    tp_comm_overlap_rs_dgrad: bool = setting(
        False, _ACCEPTED + "the column-parallel dgrad's reduce-scatter is always pipelined "
        "with the dgrad GEMM chunks here (what this flag asks of Megatron) unless "
        "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad")
    no_tp_comm_bulk_dgrad: bool = setting(
        False, _ACCEPTED + "Megatron's bulk overlap of the input all-gather with the dgrad "
        "GEMM is not run: the forward keeps the gathered input for the wgrad GEMM",
        "--no-tp-comm-bulk-dgrad", "--disable-tp-comm-bulk-dgrad")
    no_tp_comm_bulk_wgrad: bool = setting(
        False, _ACCEPTED + "Megatron's bulk overlap of the dgrad reduce-scatter with the "
        "wgrad GEMM is not run: the reduce-scatter is pipelined with the dgrad GEMM instead",
        "--no-tp-comm-bulk-wgrad", "--disable-tp-comm-bulk-wgrad")
    no_tp_comm_split_ag: bool = setting(
        False, _ACCEPTED + "Transformer Engine's atomic-GEMM all-gather; the chunks are always "
        "split GEMMs here", "--no-tp-comm-split-ag", "--disable-tp-comm-split-ag")
    no_tp_comm_split_rs: bool = setting(
        False, _ACCEPTED + "Transformer Engine's atomic-GEMM reduce-scatter; the chunks are "
        "always split GEMMs here", "--no-tp-comm-split-rs", "--disable-tp-comm-split-rs")
    tp_comm_overlap_cfg: Optional[str] = setting(
        None, _ACCEPTED + "Transformer Engine's userbuffers YAML (methods, SMs, CGA sizes); "
        "the rings here use the run's process groups", "--tp-comm-overlap-cfg",
        metavar="PATH")
    tp_comm_bootstrap_backend: str = setting(
        "nccl", _ACCEPTED + "how Transformer Engine bootstraps its userbuffers; the rings "
        "here use the tensor-parallel process group", "--tp-comm-bootstrap-backend",
        choices=("nccl", "mpi", "gloo"))


def tp_comm_overlap(tp: TPCommSettings) -> Optional["TPCommOverlap"]:
    """The linears' overlap of these (validated) settings; None without --tp-comm-overlap."""
    from gigatron.parallel.tensor.async_tp import TPCommOverlap

    if not tp.tp_comm_overlap:
        return None
    return TPCommOverlap(ag=not tp.no_tp_comm_overlap_ag, rs=not tp.no_tp_comm_overlap_rs)


def tp_comm_problems(s: "Settings") -> List[str]:
    """What Megatron (or gigatron) refuses with --tp-comm-overlap, one line each."""
    if not s.tp_comm.tp_comm_overlap:
        return []
    out = []
    if not s.parallel.sequence_parallel:
        out.append("--tp-comm-overlap needs --sequence-parallel (as in Megatron: the "
                   "overlapped collectives are its all-gathers and reduce-scatters): add "
                   "--sequence-parallel")
    if s.fp8.fp8_format:
        out.append("--tp-comm-overlap with --fp8-format is not supported here (the chunked "
                   "GEMMs are not composed with FP8's whole-tensor quantisation): drop one")
    return out


def tp_comm_notes(s: "Settings") -> List[str]:
    """The banner's line for --tp-comm-overlap."""
    overlap = tp_comm_overlap(s.tp_comm)
    if overlap is None:
        return []
    if s.parallel.tp == 1:
        return ["--tp-comm-overlap: no effect at --tensor-model-parallel-size 1 (no "
                "tensor-parallel communication)"]
    halves = [name for name, on in (("all-gathers", overlap.ag),
                                    ("reduce-scatters", overlap.rs)) if on]
    what = " and ".join(halves) or "nothing (both halves disabled)"
    return [f"--tp-comm-overlap: the transformer layers' sequence-parallel {what} run as "
            f"rings of tp chunks under the GEMMs (docs/PERFORMANCE.md)"]
