"""A step's data-parallel traffic, the part of it the overlaps that run leave exposed, and
the optimizer step (cost.py's `step_cost` adds them after the pipeline).

Routed experts' parameters are reduced over the expert-data-parallel group, the rest over
dp x cp; a collective over nodes gets the NICs of the group's ranks on each node
(cost._group_link). Each overlap follows layer.py's rule (`layer.exposed`: the first piece
waited for, the rest hidden behind the compute beside it up to that compute's time):
  gradient reduction  --overlap-grad-reduce (DeepSpeed's overlap_comm): buckets reduced from
                      backward hooks behind the last micro-batch's backward; the last bucket's
                      gradients exist only when the backward ends: exposed. Off: all exposed.
  ZeRO-1/2 gather     --overlap-param-gather: each bucket's all-gather issued after the step
                      and waited for at its first use in the next forward, so it hides behind
                      the first micro-batch's forward except the first bucket. Off: after the
                      step, all exposed.
  ZeRO-3 gathers      each gather unit (a layer; the rest of the model one more) gathered in
                      forward and again in backward for every micro-batch; with prefetch
                      (ZeroConfig.stage3_prefetch, on by default, or --overlap-param-gather)
                      unit i+1 is gathered while unit i computes: the first unit exposed, the
                      rest behind that pass's compute. Off: all exposed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Tuple

from gigatron.parallel.zero.accounting import zero_comm_bytes_formula
from gigatron.training.observe.devices import Hardware
from gigatron.training.plan.layer import exposed
from gigatron.training.plan.memory import expert_data_parallel_size

if TYPE_CHECKING:
    from gigatron.training.config.run_config import RunConfig

OPTIMIZER_BYTES_PER_ELEMENT = {"adamw": 40, "adam": 40, "sgd": 20}
"""Bytes one optimizer step reads and writes per fp32 master element: Adam moves master,
two moments, gradient and the parameter copy, plus the norm's read and the grad zeroing."""


def overlaps_param_gather(run: "RunConfig") -> bool:
    """Whether the run overlaps ZeRO-1/2's parameter all-gather with the next forward
    (--overlap-param-gather)."""
    return bool(getattr(run.zero, "overlap_param_gather", False) or
                run.settings.precision.overlap_param_gather)


def dp_cost(run: "RunConfig", parameters: int, hw: Hardware, num_microbatches: int,
            micro_batch: Tuple[float, float], byte_rate: float, expert_parameters: int = 0,
            gather_overlap: bool = False, gather_units: int = 1) -> Dict[str, float]:
    """Data-parallel traffic of one rank, the part left exposed, and the optimizer step
    (`micro_batch`: one micro-batch's forward and backward on the stage; `gather_overlap`:
    ZeRO-1/2's all-gather behind the next forward; `gather_units`: ZeRO-3's gather units on
    the stage)."""
    from gigatron.training.plan.cost import (MEMORY_EFFICIENCY, NETWORK_EFFICIENCY,
                                             _group_link, _width)

    forward, backward = micro_batch
    c, p, z = run.model, run.parallel, run.zero
    assert c is not None
    param_bytes, grad_bytes = _width(c), z.reduce_dtype.itemsize
    shards = p.dp * p.context_parallel_size  # the ranks sharing the model: dp x cp
    groups: List[Tuple[int, int]] = [(parameters - expert_parameters, shards)]
    if expert_parameters:
        groups.append((expert_parameters, expert_data_parallel_size(
            p.tp, shards, p.ep, p.etp or p.tp)))
    grads = gather = stage3 = shard = total = 0.0
    for count, size in groups:  # each group's ranks lie within the stage's tp x cp x dp ranks
        link = _group_link(size, p.tp * shards // size, hw) if size > 1 else 1.0
        rate = link * 1e9 * NETWORK_EFFICIENCY
        share = count * (size - 1) / size if size > 1 else 0.0
        grads += (2 if z.zero_stage == 0 else 1) * share * grad_bytes / rate
        gather += share * param_bytes / rate if z.zero_stage in (1, 2) else 0.0
        stage3 += 2 * num_microbatches * share * param_bytes / rate if z.zero_stage == 3 \
            else 0.0
        shard += count / (size if z.zero_stage >= 1 else 1)
        total += zero_comm_bytes_formula(count, size, z.zero_stage, grad_bytes, param_bytes) \
            if size > 1 else 0.0
    first_bucket = min(1.0, z.reduce_bucket_size / max(1, parameters))
    waited = exposed(grads, first_bucket, backward if z.overlap_comm else 0.0) + \
        exposed(gather, first_bucket, forward if gather_overlap else 0.0)
    if stage3:
        prefetch = getattr(z, "stage3_prefetch", True) or overlaps_param_gather(run)
        per_pass, first_unit = stage3 / (2 * num_microbatches), 1.0 / max(1, gather_units)
        waited += num_microbatches * sum(
            exposed(per_pass, first_unit, compute if prefetch else 0.0)
            for compute in (forward, backward))
    per_element = OPTIMIZER_BYTES_PER_ELEMENT.get(z.optimizer, 40)
    optimizer = shard * per_element / byte_rate
    if z.offload_optimizer == "cpu":  # the step runs in host memory; grads and params cross
        host = hw.hbm_gbps if hw.key == "cpu" and hw.hbm_gbps else 50.0
        optimizer = shard * per_element / (host * 1e9 * MEMORY_EFFICIENCY) + \
            shard * (4 + param_bytes) / (25e9 * NETWORK_EFFICIENCY)
    return {"total": grads + gather + stage3, "exposed": waited, "optimizer": optimizer,
            "bytes": total}
