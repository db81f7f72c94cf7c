"""Which decoder layers each pipeline stage (and each virtual chunk of it) builds.

Megatron's flags and meanings:
- uniform split by default: `--num-layers` must divide by `--pipeline-model-parallel-size`;
- `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers` give the first /
  last stage a different count; the other stages share the rest evenly;
- `--num-layers-per-virtual-pipeline-stage N` cuts every stage into v chunks of N layers for
  the interleaved schedule (v = layers per stage / N); `--num-virtual-stages-per-pipeline-rank
  v` (Megatron-Core's newer spelling, the two exclusive) gives v itself, and each stage's
  layers, uneven first/last stages' too, must divide by it (v = 1: no interleaving). Virtual stage (chunk c, rank r) is number
  c * pp + r in the model: activations go rank 0..pp-1 for chunk 0, then wrap to rank 0 for
  chunk 1, and so on. The embedding lives on (rank 0, chunk 0), the final norm + output layer +
  loss on (rank pp-1, chunk v-1).
Pure: no torch, no processes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .schedules import stage_position, virtual_stage

PP_FLAG = "--pipeline-model-parallel-size"
FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
VIRTUAL_FLAG = "--num-layers-per-virtual-pipeline-stage"
STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"


def _check_positive(value: Optional[int], flag: str) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")


def stage_layer_counts(num_layers: int, pp_size: int, first_stage_layers: Optional[int] = None,
                       last_stage_layers: Optional[int] = None) -> List[int]:
    """Number of decoder layers on each pipeline stage, with Megatron's uneven-ends flags."""
    _check_positive(num_layers, "--num-layers")
    _check_positive(pp_size, PP_FLAG)
    _check_positive(first_stage_layers, FIRST_FLAG)
    _check_positive(last_stage_layers, LAST_FLAG)
    if pp_size > num_layers:
        raise ValueError(f"{PP_FLAG}={pp_size} is larger than --num-layers={num_layers}: every "
                         f"stage needs at least one layer; use fewer stages or more layers")
    given = {0: first_stage_layers, pp_size - 1: last_stage_layers}
    if pp_size == 1:
        if first_stage_layers is not None or last_stage_layers is not None:
            raise ValueError(f"{FIRST_FLAG} / {LAST_FLAG} need {PP_FLAG} > 1 (got 1): "
                             f"drop them or use pipeline parallelism")
        return [num_layers]
    fixed = {stage: n for stage, n in given.items() if n is not None}
    middle = [s for s in range(pp_size) if s not in fixed]
    rest = num_layers - sum(fixed.values())
    if not middle:
        if rest != 0:
            raise ValueError(f"{FIRST_FLAG}={first_stage_layers} + {LAST_FLAG}="
                             f"{last_stage_layers} must equal --num-layers={num_layers} "
                             f"with {PP_FLAG}=2")
        return [fixed[0], fixed[1]]
    if rest < len(middle) or rest % len(middle):
        what = (f"--num-layers={num_layers} minus {FIRST_FLAG}/{LAST_FLAG} leaves {rest} "
                f"layers" if fixed else f"--num-layers={num_layers}")
        raise ValueError(f"{what}, which does not split evenly over the {len(middle)} other "
                         f"stages of {PP_FLAG}={pp_size}: make it a multiple of "
                         f"{len(middle)} or set {FIRST_FLAG} / {LAST_FLAG}")
    per_stage = rest // len(middle)
    return [fixed.get(s, per_stage) for s in range(pp_size)]


@dataclass(frozen=True)
class PipelinePartition:
    """Global layer ranges per (pipeline rank, virtual chunk); `layers[rank][chunk]`."""

    pp_size: int
    virtual_chunks: int
    layers: Tuple[Tuple[range, ...], ...]
    placement: str = "loop"  # where virtual stages sit: schedules.placement_of ("v": zbv)

    def layer_range(self, pp_rank: int, chunk: int = 0) -> range:
        """Global decoder layer numbers built by this rank's model chunk."""
        return self.layers[pp_rank][chunk]

    def pre_process(self, pp_rank: int, chunk: int = 0) -> bool:
        """True where the embedding lives: the first virtual stage."""
        return virtual_stage(pp_rank, chunk, self.pp_size, self.placement) == 0

    def post_process(self, pp_rank: int, chunk: int = 0) -> bool:
        """True where the final norm, output layer and loss live: the last virtual stage."""
        last = self.pp_size * self.virtual_chunks - 1
        return virtual_stage(pp_rank, chunk, self.pp_size, self.placement) == last

    def describe(self) -> str:
        """One line per rank listing its chunks' layers (for logs)."""
        lines = []
        for rank, chunks in enumerate(self.layers):
            parts = [f"chunk {c}: layers {r.start}-{r.stop - 1}" for c, r in enumerate(chunks)]
            lines.append(f"pipeline stage {rank}: " + "; ".join(parts))
        return "\n".join(lines)


def partition_layers(num_layers: int, pp_size: int, *, first_stage_layers: Optional[int] = None,
                     last_stage_layers: Optional[int] = None,
                     num_layers_per_virtual_stage: Optional[int] = None,
                     virtual_stages_per_rank: Optional[int] = None,
                     placement: str = "loop") -> PipelinePartition:
    """Split the decoder over pipeline stages and virtual chunks, Megatron's way; virtual
    stages sit where the schedule's `placement` puts them ("v": rank r holds stages r and
    2pp-1-r)."""
    counts = stage_layer_counts(num_layers, pp_size, first_stage_layers, last_stage_layers)
    virtual = 1
    if virtual_stages_per_rank is not None:
        virtual = _virtual_stages(counts, num_layers_per_virtual_stage, virtual_stages_per_rank)
    elif num_layers_per_virtual_stage is not None:
        _check_positive(num_layers_per_virtual_stage, VIRTUAL_FLAG)
        if pp_size == 1:
            raise ValueError(f"{VIRTUAL_FLAG} (interleaved schedule) needs {PP_FLAG} > 1: "
                             f"drop it for a single stage")
        # Megatron derives v from a middle stage (or the uniform one).
        reference = counts[1] if pp_size > 2 else counts[0]
        if reference % num_layers_per_virtual_stage:
            raise ValueError(f"{VIRTUAL_FLAG}={num_layers_per_virtual_stage} must divide the "
                             f"{reference} layers per pipeline stage")
        virtual = reference // num_layers_per_virtual_stage
        for stage, n in enumerate(counts):
            if n % virtual:
                raise ValueError(f"stage {stage} has {n} layers, not divisible into the "
                                 f"{virtual} virtual chunks set by {VIRTUAL_FLAG}="
                                 f"{num_layers_per_virtual_stage}: change {FIRST_FLAG} / "
                                 f"{LAST_FLAG} or {VIRTUAL_FLAG}")
    return _assign(counts, virtual, placement)


def _virtual_stages(counts: List[int], layers_per_virtual_stage: Optional[int],
                    stages_per_rank: int) -> int:
    """--num-virtual-stages-per-pipeline-rank's chunks per rank, as Megatron-LM checks it."""
    _check_positive(stages_per_rank, STAGES_FLAG)
    if layers_per_virtual_stage is not None:
        raise ValueError(f"{VIRTUAL_FLAG} and {STAGES_FLAG} are exclusive (Megatron-LM "
                         f"asserts it): give one of them")
    if stages_per_rank > 1 and len(counts) == 1:
        raise ValueError(f"{STAGES_FLAG}={stages_per_rank} (interleaved schedule) needs "
                         f"{PP_FLAG} > 1: drop it for a single stage")
    for stage, n in enumerate(counts):
        if n % stages_per_rank:
            raise ValueError(f"stage {stage} has {n} layers, not divisible into {STAGES_FLAG}="
                             f"{stages_per_rank} chunks: change --num-layers, {FIRST_FLAG} / "
                             f"{LAST_FLAG} or {STAGES_FLAG}")
    return stages_per_rank


def _assign(counts: List[int], virtual: int, placement: str) -> PipelinePartition:
    """Each (rank, chunk)'s layer range: virtual stages in model order, where `placement`
    puts them."""
    pp_size = len(counts)
    ranges: List[List[range]] = [[range(0)] * virtual for _ in range(pp_size)]
    start = 0
    for stage in range(pp_size * virtual):  # virtual stages in model order
        rank, chunk = stage_position(stage, pp_size, placement)
        n = counts[rank] // virtual
        ranges[rank][chunk] = range(start, start + n)
        start += n
    return PipelinePartition(pp_size, virtual, tuple(tuple(r) for r in ranges), placement)
