"""One layout's plan: a validated RunConfig and a device in, memory per stage and step time out."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional

from gigatron.parallel.pipeline.partition import PipelinePartition
from gigatron.training.config.run_config import RunConfig
from gigatron.training.plan.allocator import device_bytes, reserved_bytes
from gigatron.training.plan.context import ContextLayout, layout_of
from gigatron.training.plan.cost import StepCost, Throughput, step_cost, throughput
from gigatron.training.observe.devices import Hardware
from gigatron.training.plan.memory import GIB, StageMemory, plan_memory


@dataclass(frozen=True)
class Plan:
    """What `gigatron plan` predicts for one layout on one device type."""

    run: RunConfig
    hardware: Hardware
    stages: List[StageMemory]
    cost: StepCost
    rates: Throughput

    @property
    def peak_bytes(self) -> float:
        """The highest peak of any rank."""
        return max(m.peak for m in self.stages)

    @property
    def reported_bytes(self) -> float:
        """The highest peak as torch's caching allocator reserves it (max_memory_reserved:
        allocator.py), the figure torchtitan logs."""
        return reserved_bytes(self.peak_bytes) if self.on_gpu else self.peak_bytes

    @property
    def device_bytes(self) -> float:
        """The highest peak as the device holds it (nvidia-smi): reserved, the CUDA context
        and NCCL's buffers (allocator.py)."""
        return stages_device_bytes(self.run, self.hardware, self.stages)

    @property
    def on_gpu(self) -> bool:
        return self.hardware.key != "cpu"

    @property
    def capacity_bytes(self) -> float:
        return capacity_bytes(self.hardware)

    @property
    def fits(self) -> bool:
        """Whether the device's whole use (`device_bytes`) fits its memory."""
        return self.device_bytes <= self.capacity_bytes


def stages_device_bytes(run: RunConfig, hw: Hardware, stages: List[StageMemory]) -> float:
    """The highest peak of `stages` as the device holds it (`Plan.device_bytes`)."""
    p = run.parallel
    return device_bytes(max(m.peak for m in stages),
                        (p.tp, p.pp, p.dp * p.context_parallel_size, p.context_parallel_size,
                         p.ep), hw.key != "cpu")


def capacity_bytes(hw: Hardware) -> float:
    assert hw.memory_gib is not None
    return hw.memory_gib * GIB


def fill_plan_flags(flags: argparse.Namespace, search: bool) -> None:
    """A plan trains nothing: the settings only training reads (iterations, learning rate,
    data) get `gigatron generate`'s stand-ins where not given; the micro-batch size stays
    required unless --search varies it."""
    from gigatron.training.run.from_checkpoint import DATA_SOURCES, fill_training_only

    fill_training_only(vars(flags), skip=() if search else ("micro_batch_size",))
    if not any(getattr(flags, name) for name in DATA_SOURCES):
        flags.mock_data = True


def partition_of(run: RunConfig) -> PipelinePartition:
    """The run's layer partition (the builders' own function)."""
    from gigatron.training.run.builders import partition

    return partition(run)


def context_of(run: RunConfig) -> ContextLayout:
    """The run's context parallelism as the plan models it."""
    return layout_of(run.parallel)


def plan_stages(run: RunConfig, hw: Hardware,
                memo: Optional[Dict[tuple, tuple]] = None) -> List[StageMemory]:
    """Memory of every pipeline stage of `run` on `hw` devices (`plan_run`'s first half:
    --search checks it fits before it costs the step; `memo`: memory.stage_memory's, kept
    across the layouts of one model)."""
    c, p, t = run.model, run.parallel, run.train
    assert c is not None and t.micro_batch_size is not None
    return plan_memory(c, partition_of(run), p.tp, p.dp, run.zero, t.micro_batch_size,
                       t.num_microbatches, hw.key != "cpu", p.ep, p.etp, context_of(run),
                       p.pipeline_schedule, memo)


def plan_run(run: RunConfig, hw: Hardware, assume: FrozenSet[str] = frozenset(),
             stages: Optional[List[StageMemory]] = None) -> Plan:
    """Memory of every pipeline stage and the step's cost for `run` on `hw` devices
    (`assume`: Megatron-Core overlaps to model, cost.OVERLAPS; `stages`: `plan_stages`'s,
    when already known)."""
    on_gpu = hw.key != "cpu"
    partition = partition_of(run)
    stages = plan_stages(run, hw) if stages is None else stages
    cost = step_cost(run, hw, partition, [m.parameters for m in stages], on_gpu,
                     [m.expert_parameters for m in stages], assume)
    return Plan(run, hw, stages, cost, throughput(run, cost, hw))
