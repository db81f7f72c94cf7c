"""`gigatron plan --search`: every layout of the model on the GPU count, ranked or refused.

A layout is (tp, pp, cp, dp, ZeRO stage, recomputation, micro-batch size, and for a mixture of
experts the expert-parallel size ep: each divisor of --num-experts whose etp x ep divides
tp x dp, etp the flag's or tp; with pp > 1 the pipeline schedule: `schedules`), with sequence
parallelism whenever tp > 1 and the user's global batch; --tp-comm-overlap and
--overlap-param-gather, when given, apply where the layout has tp > 1 / ZeRO stage >= 1; a
pipeline whose stages do not divide the layers is split unevenly (`uneven_split`). Each one
is validated by the same `build_run_config` the real run uses (its error is the rejection reason), then planned; those
that fit the device's memory are ranked by predicted step time, the others are refused with
the stage and bytes that do not fit.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass
from typing import (TYPE_CHECKING, Callable, Dict, FrozenSet, Iterator, List, Optional,
                    Tuple)

from gigatron.training.observe.devices import Hardware
from gigatron.training.plan.memory import GIB
from gigatron.training.plan.planner import (Plan, capacity_bytes, plan_run, plan_stages,
                                            stages_device_bytes)

if TYPE_CHECKING:
    from gigatron.data.tokenizer import Tokenizer
    from gigatron.training.config.table import Settings

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
    cp: int = 1  # context-parallel size (the flags' --cp-comm-type)
    schedule: str = "1f1b"  # --pipeline-schedule
    virtual_stage_layers: Optional[int] = None  # zbv's 2 chunks per stage: layers / (2 pp)
    first_stage_layers: Optional[int] = None  # an uneven split (`uneven_split`)
    last_stage_layers: Optional[int] = None

    def describe(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp}"
                f"{'' if self.cp == 1 else f' cp={self.cp}'}"
                f"{'' if self.ep is None else f' ep={self.ep}'} zero={self.zero_stage} "
                f"recompute={self.recompute} mbs={self.micro_batch_size}"
                f"{'' if self.schedule == '1f1b' else f' schedule={self.schedule}'}"
                f"{'' if self.first_stage_layers is None else f' first={self.first_stage_layers}'}"
                f"{'' if self.last_stage_layers is None else f' last={self.last_stage_layers}'}")


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


def context_sizes(ranks: int, seq_length: int) -> List[int]:
    """The cp sizes to try on `ranks` (world / (tp x pp)): divisors whose load-balanced
    split fits the sequence (seq_length divisible by 2 x cp)."""
    return [cp for cp in _divisors(ranks) if seq_length % (2 * cp) == 0 or cp == 1]


def schedules(pp: int, num_layers: int, zero_stage: int, tied_embeddings: bool) -> List[str]:
    """The pipeline schedules to try: 1f1b, and with pp > 1 zb-h1 (not under ZeRO 3) and zbv
    (where it is valid: 2 virtual chunks, untied embeddings, no ZeRO 3)."""
    if pp == 1 or zero_stage == 3:
        return ["1f1b"]
    v_shaped = not tied_embeddings and num_layers % (2 * pp) == 0
    return ["1f1b", "zb-h1"] + (["zbv"] if v_shaped else [])


def uneven_split(num_layers: int, pp: int) -> Optional[Tuple[int, int]]:
    """(first, last) stage layers for a pipeline whose stages cannot split the layers evenly
    (None: they can): the middle stages ceil(layers / pp) each, the rest over the first and
    last, the first one more where odd (Megatron-LM's DeepSeek-V3 script: 61 layers on pp 16
    as 3 + 14 x 4 + 2); (-1, -1) where fewer than two are left for them."""
    if num_layers % pp == 0:
        return None
    per = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * per
    if rest < 2:
        return -1, -1
    return -(-rest // 2), rest // 2


def layouts(world_size: int, num_layers: int, gpus_per_node: int,
            num_experts: Optional[int] = None, etp: Optional[int] = None,
            seq_length: int = 1, tied_embeddings: bool = True) -> Iterator[Layout]:
    """The search space: tp within a node, pp up to one layer per stage (split unevenly where
    the layers do not divide: `uneven_split`), cp over the rest (`context_sizes`), ep over
    the experts (`expert_sizes`), the pipeline `schedules`."""
    for tp in _divisors(world_size):
        if tp > gpus_per_node:
            continue
        for pp in _divisors(world_size // tp):
            if pp > num_layers:
                continue
            split = uneven_split(num_layers, pp)  # none possible: validation says why
            first, last = (None, None) if split in (None, (-1, -1)) else split
            for cp in context_sizes(world_size // (tp * pp), seq_length):
                dp = world_size // (tp * pp * cp)
                for ep in expert_sizes(num_experts, tp, dp * cp, etp):
                    for zero in ZERO_STAGES:
                        for recompute in RECOMPUTE:
                            for mbs in MICRO_BATCH_SIZES:
                                for name in schedules(pp, num_layers, zero, tied_embeddings):
                                    yield Layout(tp, pp, dp, zero, recompute, mbs, ep, cp,
                                                 name, num_layers // (2 * pp)
                                                 if name == "zbv" else None, first, last)


def _layout_values(flags: argparse.Namespace, layout: Layout,
                   global_batch_size: int) -> Dict[str, object]:
    """The flags (by argparse dest) a layout sets: its sizes, recomputation, schedule."""
    granularity, method, num = RECOMPUTE[layout.recompute]
    out: Dict[str, object] = {
        "tensor_model_parallel_size": layout.tp, "pipeline_model_parallel_size": layout.pp,
        "micro_batch_size": layout.micro_batch_size, "global_batch_size": global_batch_size,
        "zero_stage": layout.zero_stage, "use_distributed_optimizer": False,
        "recompute_granularity": granularity, "recompute_method": method,
        "recompute_num_layers": num, "sequence_parallel": layout.tp > 1,
        # the overlaps the flags ask for, where the layout has what they overlap
        "tp_comm_overlap": getattr(flags, "tp_comm_overlap", False) and layout.tp > 1,
        "overlap_param_gather": getattr(flags, "overlap_param_gather", False) and
        layout.zero_stage >= 1,
        "context_parallel_size": layout.cp}
    sizes = getattr(flags, "hierarchical_context_parallel_sizes", None)
    if flags.cp_comm_type == "a2a+p2p" and sizes:  # the given a2a size A, the ring over cp/A
        if layout.cp == 1:
            out["cp_comm_type"], out["hierarchical_context_parallel_sizes"] = "p2p", None
        elif layout.cp % sizes[0] == 0:  # else refused: A x P must be cp
            out["hierarchical_context_parallel_sizes"] = [sizes[0], layout.cp // sizes[0]]
    out.update(pipeline_schedule=layout.schedule,
               num_layers_per_virtual_pipeline_stage=layout.virtual_stage_layers,
               decoder_first_pipeline_num_layers=layout.first_stage_layers,
               decoder_last_pipeline_num_layers=layout.last_stage_layers,
               gradient_accumulation_steps=None)
    if layout.ep is not None:
        out["expert_model_parallel_size"] = layout.ep
    return out


def _flags_for(flags: argparse.Namespace, layout: Layout,
               global_batch_size: int) -> argparse.Namespace:
    out = copy.copy(flags)
    for dest, value in _layout_values(flags, layout, global_batch_size).items():
        setattr(out, dest, value)
    return out


class Shared:
    """What every layout of one search shares: the flags' settings, built once (a layout's
    are these with its own flags' fields replaced: `settings_for`), and the stages' model
    state by layout sizes (memory.stage_memory's memo)."""

    def __init__(self, flags: argparse.Namespace) -> None:
        from gigatron.training.config.table import build_settings

        self.flags, self.settings = flags, build_settings(flags)
        self.memo: Dict[tuple, tuple] = {}

    def settings_for(self, values: Dict[str, object]) -> "Settings":
        """build_settings of the flags with a layout's `values` (`_layout_values`): those
        rows replaced, each concern's dataclass once."""
        from gigatron.training.config.table import row_of

        changed: Dict[str, Dict[str, object]] = {}
        for dest, value in values.items():
            row = row_of(dest)
            changed.setdefault(row.concern, {})[row.field] = value
        return dataclasses.replace(self.settings, **{
            concern: dataclasses.replace(getattr(self.settings, concern), **fields)
            for concern, fields in changed.items()})


def evaluate(flags: argparse.Namespace, layout: Layout, world_size: int,
             global_batch_size: int, tokenizer: Optional["Tokenizer"],
             hw: Hardware, assume: FrozenSet[str] = frozenset(),
             shared: Optional[Shared] = None) -> Candidate:
    """Validate `layout` as the run would (`tokenizer`: the flags' own, built once for every
    layout), plan its memory and, if it fits, its step (`shared`: what the search's layouts
    share; None: everything built for this layout alone)."""
    from gigatron.training.config.arguments import build_run, build_run_config

    try:
        run = build_run_config(_flags_for(flags, layout, global_batch_size), world_size,
                               tokenizer) if shared is None else \
            build_run(shared.settings_for(_layout_values(flags, layout, global_batch_size)),
                      world_size, tokenizer)[0]
    except ValueError as err:
        lines = getattr(err, "problems", str(err).splitlines())
        return Candidate(layout, reason="; ".join(lines))
    # memory first: a layout that does not fit is not costed
    stages = plan_stages(run, hw, None if shared is None else shared.memo)
    need, capacity = stages_device_bytes(run, hw, stages), capacity_bytes(hw)
    if need > capacity:
        worst = max(stages, key=lambda m: m.peak)
        return Candidate(layout, reason=(
            f"out of memory: stage {worst.pp_rank} needs {need / GIB:.1f} GiB "
            f"on the device ({worst.peak / GIB:.1f} allocated), the {hw.key} has "
            f"{capacity / GIB:.1f}"))
    return Candidate(layout, plan_run(run, hw, assume, stages))


def _model_sizes(flags: argparse.Namespace) -> Tuple[int, Optional[int], int, bool]:
    """(layers, routed experts, sequence length, tied embeddings) of the model the flags
    describe (a --model zoo entry with its overrides), whatever their layout; the flags'
    own values where the model cannot be built (its problems are each layout's)."""
    from gigatron.training.config.megatron.model import build_model_config
    from gigatron.training.config.table import build_settings
    from gigatron.training.config.validation import Problems

    model = build_model_config(build_settings(flags), None, Problems())
    if model is None:
        return (flags.num_layers or 1, getattr(flags, "num_experts", None),
                getattr(flags, "seq_length", None) or 1,
                not getattr(flags, "untie_embeddings_and_output_weights", False))
    return (model.num_layers, model.num_moe_experts, model.seq_length,
            not model.untie_embeddings_and_output_weights)


def search(flags: argparse.Namespace, world_size: int, global_batch_size: int,
           tokenizer: Optional["Tokenizer"], hw: Hardware,
           assume: FrozenSet[str] = frozenset(),
           progress: Optional[Callable[[int, int], None]] = None, share: bool = True
           ) -> Tuple[List[Candidate], List[Candidate]]:
    """(layouts that fit, fastest first; layouts refused, each with its reason; `assume`:
    cost.OVERLAPS to model; `progress(done, total)` after each layout; `share`: build the
    settings once and keep the stages' model state across layouts (`Shared`; False: each
    layout on its own, the same answer slower))."""
    ranked: List[Candidate] = []
    refused: List[Candidate] = []
    num_layers, num_experts, seq_length, tied = _model_sizes(flags)
    space = list(layouts(world_size, num_layers, hw.gpus_per_node, num_experts,
                         flags.expert_tensor_parallel_size, seq_length, tied))
    shared = Shared(flags) if share else None
    # shared: one pipeline shape's layouts one after another (its schedules, program and
    # held states are then built once, not again after the caches moved on), answered in
    # the space's order
    order = sorted(range(len(space)), key=lambda n: _pipeline_shape(
        space[n], global_batch_size)) if share else range(len(space))
    candidates: List[Optional[Candidate]] = [None] * len(space)
    for done, n in enumerate(order, 1):
        candidates[n] = evaluate(flags, space[n], world_size, global_batch_size, tokenizer,
                                 hw, assume, shared)
        if progress is not None:
            progress(done, len(space))
    for candidate in candidates:
        assert candidate is not None
        (refused if candidate.reason else ranked).append(candidate)
    ranked.sort(key=lambda c: c.plan.cost.step if c.plan else 0.0)
    return ranked, refused


def _pipeline_shape(layout: Layout, global_batch_size: int) -> Tuple[int, int, str, int]:
    """(pp, micro-batches, schedule, virtual stage layers): what the pipeline schedules a
    layout plans with depend on."""
    return (layout.pp, global_batch_size // (layout.micro_batch_size * layout.dp),
            layout.schedule, layout.virtual_stage_layers or 0)
