"""`gigatron plan --search`: every layout of the model on the GPU count, ranked or refused.

A layout is (tp, pp, dp, ZeRO stage, recomputation, micro-batch size, and for a mixture of
experts the expert-parallel size ep: each divisor of --num-experts whose etp x ep divides
tp x dp, etp the flag's or tp), with sequence
parallelism whenever tp > 1 and the user's global batch. Each one is validated by the same
`build_run_config` the real run uses (its error is the rejection reason), then planned; those
that fit the device's memory are ranked by predicted step time, the others are refused with
the stage and bytes that do not fit.
"""
from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, List, Optional, Tuple

from gigatron.training.observe.devices import Hardware
from gigatron.training.plan.memory import GIB
from gigatron.training.plan.planner import Plan, plan_run

if TYPE_CHECKING:
    from gigatron.data.tokenizer import Tokenizer

RECOMPUTE = {"none": (None, None, None), "selective": ("selective", None, None),
             "full": ("full", "uniform", 1)}
MICRO_BATCH_SIZES = (1, 2, 4, 8)
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    tp: int
    pp: int
    dp: int
    zero_stage: int
    recompute: str
    micro_batch_size: int
    ep: Optional[int] = None  # expert-parallel size; None: a dense model

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}"
                f"{'' if self.ep is None else f' ep={self.ep}'} zero={self.zero_stage} "
                f"recompute={self.recompute} mbs={self.micro_batch_size}")


@dataclass(frozen=True)
class Candidate:
    """A layout and its plan, or the reason it cannot run."""

    layout: Layout
    plan: Optional[Plan] = None
    reason: Optional[str] = None


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expert_sizes(num_experts: Optional[int], tp: int, dp: int,
                 etp: Optional[int]) -> List[Optional[int]]:
    """The ep sizes to try: divisors of the experts with etp x ep dividing tp x dp (etp
    None: tp); [None] for a dense model."""
    if num_experts is None:
        return [None]
    expert_tp = tp if etp is None else etp
    return [ep for ep in _divisors(num_experts) if (tp * dp) % (expert_tp * ep) == 0]


def layouts(world_size: int, num_layers: int, gpus_per_node: int,
            num_experts: Optional[int] = None, etp: Optional[int] = None) -> Iterator[Layout]:
    """The search space: tp within a node, pp up to one layer per stage, ep over the
    experts (`expert_sizes`)."""
    for tp in _divisors(world_size):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(world_size // tp):
            if pp > num_layers:
                continue
            dp = world_size // (tp * pp)
            for ep in expert_sizes(num_experts, tp, dp, etp):
                for zero in ZERO_STAGES:
                    for recompute in RECOMPUTE:
                        for mbs in MICRO_BATCH_SIZES:
                            yield Layout(tp, pp, dp, zero, recompute, mbs, ep)


def _flags_for(flags: argparse.Namespace, layout: Layout,
               global_batch_size: int) -> argparse.Namespace:
    out = copy.copy(flags)
    granularity, method, num = RECOMPUTE[layout.recompute]
    out.tensor_model_parallel_size, out.pipeline_model_parallel_size = layout.tp, layout.pp
    out.micro_batch_size, out.global_batch_size = layout.micro_batch_size, global_batch_size
    out.zero_stage, out.use_distributed_optimizer = layout.zero_stage, False
    out.recompute_granularity, out.recompute_method, out.recompute_num_layers = \
        granularity, method, num
    out.sequence_parallel = layout.tp > 1
    out.num_layers_per_virtual_pipeline_stage = None
    out.gradient_accumulation_steps = None
    if layout.ep is not None:
        out.expert_model_parallel_size = layout.ep
    return out


def evaluate(flags: argparse.Namespace, layout: Layout, world_size: int,
             global_batch_size: int, tokenizer: Optional["Tokenizer"],
             hw: Hardware) -> Candidate:
    """Validate `layout` as the run would (`tokenizer`: the flags' own, built once for every
    layout), plan it and say whether it fits."""
    from gigatron.training.config.arguments import build_run_config

    try:
        run = build_run_config(_flags_for(flags, layout, global_batch_size), world_size,
                               tokenizer)
    except ValueError as err:
        lines = getattr(err, "problems", str(err).splitlines())
        return Candidate(layout, reason="; ".join(lines))
    plan = plan_run(run, hw)
    if not plan.fits:
        worst = max(plan.stages, key=lambda m: m.peak)
        return Candidate(layout, plan, reason=(
            f"out of memory: stage {worst.pp_rank} needs {worst.peak / GIB:.1f} GiB, the "
            f"{hw.key} has {plan.capacity_bytes / GIB:.1f}"))
    return Candidate(layout, plan)


def _model_sizes(flags: argparse.Namespace, world_size: int,
                 tokenizer: Optional["Tokenizer"]) -> Tuple[int, Optional[int]]:
    """(layers, routed experts) of the model the flags build (a --model zoo entry too)."""
    from gigatron.training.config.arguments import build_run_config

    try:
        model = build_run_config(flags, world_size, tokenizer).model
    except ValueError:  # the user's own layout is refused: the flags' own sizes
        return flags.num_layers or 1, getattr(flags, "num_experts", None)
    assert model is not None
    return model.num_layers, model.num_moe_experts


def search(flags: argparse.Namespace, world_size: int, global_batch_size: int,
           tokenizer: Optional["Tokenizer"],
           hw: Hardware) -> Tuple[List[Candidate], List[Candidate]]:
    """(layouts that fit, fastest first; layouts refused, each with its reason)."""
    ranked: List[Candidate] = []
    refused: List[Candidate] = []
    num_layers, num_experts = _model_sizes(flags, world_size, tokenizer)
    for layout in layouts(world_size, num_layers, hw.gpus_per_node, num_experts,
                          flags.expert_tensor_parallel_size):
        candidate = evaluate(flags, layout, world_size, global_batch_size, tokenizer, hw)
        (refused if candidate.reason else ranked).append(candidate)
    ranked.sort(key=lambda c: c.plan.cost.step if c.plan else 0.0)
    return ranked, refused
