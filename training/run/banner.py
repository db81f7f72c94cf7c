"""The start-up banner's "parallel:" line: the pipeline schedule a run executes and every
parallel, memory and ZeRO choice that is not the default, so a log says how the run was laid
out without the command line beside it. Pure: a RunConfig in, text out (tests/test_banner.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, List

if TYPE_CHECKING:
    from gigatron.training.config.run_config import ParallelConfig, RunConfig


def schedule_phrase(p: "ParallelConfig", virtual_chunks: int, num_microbatches: int) -> str:
    """The schedule `build_schedule` runs for these settings, named as a user would:
    'none (pp=1: no pipelining)', '1F1B', 'interleaved 1F1B (2 virtual stages per rank)', 'zb-h1 (zero
    bubble H1)', 'zbv (zero bubble V)'; with the stage and micro-batch counts."""
    counts = f"{p.pp} stages x {num_microbatches} micro-batches"
    if p.pipeline_schedule == "zb-h1":
        return f"schedule zb-h1 (zero bubble H1, split backward), {counts}"
    if p.pipeline_schedule == "zbv":
        return f"schedule zbv (zero bubble V, {virtual_chunks} chunks per rank), {counts}"
    if p.pp == 1 and virtual_chunks == 1:
        return f"schedule none (pp=1: no pipelining), {num_microbatches} micro-batches"
    if virtual_chunks == 1:
        return f"schedule 1F1B, {counts}"
    return f"schedule interleaved 1F1B ({virtual_chunks} virtual stages per rank), {counts}"


def parallel_choices(run: "RunConfig", virtual_chunks: int) -> List[str]:
    """The schedule, then each choice that differs from the default: sequence parallel,
    context parallel and its attention, expert parallel, ZeRO and where its state lives,
    gradient reduction, activation recomputation, the split backward."""
    p, s, m = run.parallel, run.settings, run.model
    parts = [schedule_phrase(p, virtual_chunks, run.train.num_microbatches)]
    if p.delay_wgrad_compute:
        parts.append("weight gradients delayed (--delay-wgrad-compute)")
    if p.sequence_parallel:
        parts.append("sequence parallel")
    if p.context_parallel_size > 1:
        kind = p.cp_comm_type
        if p.hierarchical_context_parallel_sizes:
            kind += " " + "x".join(map(str, p.hierarchical_context_parallel_sizes))
        parts.append(f"context parallel {p.context_parallel_size} ({kind})")
    if p.ep > 1 or (getattr(m, "num_moe_experts", None) and p.etp != p.tp):
        parts.append(f"expert parallel ep={p.ep} etp={p.etp}")
    if run.zero.zero_stage:
        how = " (--use-distributed-optimizer)" if s is not None and \
            s.precision.use_distributed_optimizer and s.precision.zero_stage is None else ""
        parts.append(f"ZeRO stage {run.zero.zero_stage}{how}")
    if run.zero.offload_optimizer != "none":
        parts.append(f"optimizer state offloaded to {run.zero.offload_optimizer}")
    if s is not None and s.precision.overlap_comm is False:
        parts.append("grad reduction not overlapped with backward")
    if s is not None and s.precision.grad_reduce_in_bf16 and s.precision.bf16:
        parts.append("grads reduced in bf16")
    if m.recompute_granularity == "selective":
        parts.append("recompute selective (core attention)")
    elif m.recompute_granularity == "full":
        parts.append(f"recompute full ({m.recompute_method or 'uniform'}, "
                     f"{m.recompute_num_layers or 1} layer(s))")
    return parts


def parallel_line(run: "RunConfig", virtual_chunks: int) -> str:
    """'parallel: schedule 1F1B, 2 stages x 4 micro-batches; sequence parallel; ...'."""
    return "parallel: " + "; ".join(parallel_choices(run, virtual_chunks))
