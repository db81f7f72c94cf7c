"""The zero-bubble schedules for a PipelineModule: `PipelineModule(schedule="zb-h1"|"zbv")`.

DeepSpeed's PipelineEngine has one schedule (1F1B) and no config key to choose another, and
gigatron refuses the DeepSpeed JSON's "pipeline" section (pipeline settings are
PipelineModule arguments), so the schedule is an argument of the module, beside
`virtual_stages`: "1f1b" (1F1B, or interleaved 1F1B with virtual_stages > 1), "zb-h1" or
"zbv".

zb-h1 splits each backward into B (input gradients, what the previous stage waits for) and
W (weight gradients, placed in the bubbles). A user's layers are plain torch modules, so the
split is given to the weights that `torch.nn.Linear` holds: each Linear of a zero-bubble stage
becomes a `SplitBackwardLinear` (same parameters, state-dict names and isinstance), whose
forward is `parallel/tensor/wgrad.deferrable_linear`; under the executor's deferral its
weight gradient waits for W. Other layers compute their weight gradients in B, as before,
which is exact, only less of the bubble filled.

zbv cuts the layer list into 2 x num_stages chunks (by the module's partition_method) and
places them in a V: stage i holds chunk i and chunk 2p-1-i, so the first and the last chunk
land on rank 0 as two chunks. A TiedLayerSpec used on both is refused, as pretrain_gpt.py's
--pipeline-schedule zbv refuses tied embeddings: the two chunks' backwards would each
accumulate the shared weight's gradient, which the data-parallel buckets count once.
"""
from __future__ import annotations

from typing import Dict, Iterable, List

import torch
from torch import nn

from gigatron.parallel.pipeline.schedules import ScheduleNames, check_schedule_choice
from gigatron.parallel.tensor.wgrad import deferrable_linear

SCHEDULES = ("1f1b", "zb-h1", "zbv")
ZERO_BUBBLE = ("zb-h1", "zbv")


class SplitBackwardLinear(nn.Linear):
    """nn.Linear whose weight gradient may be deferred to the schedule's W."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return deferrable_linear(input, self.weight, self.bias)


def check_schedule(schedule: str, virtual_stages: int) -> int:
    """One line when a PipelineModule cannot run `schedule`; else its chunks per stage (the
    chunk rules are the executor's own, `check_schedule_choice`, in the module's words)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"PipelineModule(schedule={schedule!r}): choose one of "
                         f"{', '.join(SCHEDULES)}")
    chunks = 2 if schedule == "zbv" and virtual_stages == 1 else virtual_stages
    if schedule in ZERO_BUBBLE:
        check_schedule_choice(schedule, chunks, ScheduleNames(
            schedule="PipelineModule(schedule=...)", virtual=f"virtual_stages={virtual_stages}"))
    return chunks


def check_v_ties(schedule: str, tied_stage_map: Dict[str, List[int]]) -> None:
    """One line when zbv's V would put a tied module's uses in two chunks of one rank."""
    tied = sorted(key for key, stages in tied_stage_map.items() if len(stages) > 1)
    if schedule == "zbv" and tied:
        raise ValueError(f"PipelineModule(schedule='zbv') puts the first and the last stage on "
                         f"rank 0 as two chunks, and TiedLayerSpec {tied[0]!r} is used on both, "
                         f"which is not supported (as pretrain_gpt.py's --pipeline-schedule zbv "
                         f"needs --untie-embeddings-and-output-weights): give the output layer "
                         f"its own weight (a LayerSpec) or use schedule='zb-h1'")


def split_linear_backward(modules: Iterable[nn.Module]) -> int:
    """Make every plain nn.Linear under `modules` a SplitBackwardLinear; how many."""
    count = 0
    for root in modules:
        for module in root.modules():
            if type(module) is nn.Linear:
                module.__class__ = SplitBackwardLinear
                count += 1
    return count
