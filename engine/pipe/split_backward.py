"""The zero-bubble schedules for a PipelineModule: `PipelineModule(schedule="zb-h1")`.

DeepSpeed's PipelineEngine has one schedule (1F1B) and no config key to choose another, and
gigatron refuses the DeepSpeed JSON's "pipeline" section (pipeline settings are
PipelineModule arguments), so the schedule is an argument of the module, beside
`virtual_stages`: "1f1b" (1F1B, or interleaved 1F1B with virtual_stages > 1) or "zb-h1".

zb-h1 splits each backward into B (input gradients, what the previous stage waits for) and
W (weight gradients, placed in the bubbles). A user's layers are plain torch modules, so the
split is given to the weights that `torch.nn.Linear` holds: each Linear of a zb-h1 stage
becomes a `SplitBackwardLinear` (same parameters, state-dict names and isinstance), whose
forward is `parallel/tensor/wgrad.deferrable_linear`; under the executor's deferral its
weight gradient waits for W. Other layers compute their weight gradients in B, as before,
which is exact, only less of the bubble filled.

zbv needs the V placement of the layer list (stage r holding stages r and 2p-1-r) and is
not offered here yet: one line says so.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from gigatron.parallel.tensor.wgrad import deferrable_linear

SCHEDULES = ("1f1b", "zb-h1")


class SplitBackwardLinear(nn.Linear):
    """nn.Linear whose weight gradient may be deferred to the schedule's W."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return deferrable_linear(input, self.weight, self.bias)


def check_schedule(schedule: str, virtual_stages: int) -> None:
    """One line when a PipelineModule cannot run `schedule`."""
    if schedule == "zbv":
        raise ValueError("PipelineModule(schedule='zbv') is not supported: its V placement "
                         "of the layers is not built for PipelineModule; use schedule="
                         "'zb-h1' (or pretrain_gpt.py's --pipeline-schedule zbv)")
    if schedule not in SCHEDULES:
        raise ValueError(f"PipelineModule(schedule={schedule!r}): choose one of "
                         f"{', '.join(SCHEDULES)}")
    if schedule == "zb-h1" and virtual_stages != 1:
        raise ValueError(f"PipelineModule(schedule='zb-h1') runs one stage per rank: drop "
                         f"virtual_stages={virtual_stages} (or use schedule='1f1b' for the "
                         f"interleaved schedule)")


def split_linear_backward(modules: Iterable[nn.Module]) -> int:
    """Make every plain nn.Linear under `modules` a SplitBackwardLinear; how many."""
    count = 0
    for root in modules:
        for module in root.modules():
            if type(module) is nn.Linear:
                module.__class__ = SplitBackwardLinear
                count += 1
    return count
