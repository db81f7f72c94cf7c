"""How `gigatron plan --search` orders the layouts that fit and sums up the ones it refused.

Ties: two layouts whose predicted steps differ by less than the model's precision
(`TIE_TOLERANCE`) are not told apart by the model, so among them the simpler one comes
first: fewer model-parallel ranks a micro-batch passes through (tp x pp x cp), then less
memory. Refusals: one line per reason (its numbers aside), with how many layouts it refused
and one of them, instead of one line per layout.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from gigatron.training.plan.search import Candidate, Layout

TIE_TOLERANCE = 0.05
"""Relative step-time difference below which two layouts tie: the scatter of the speed
model's error from one shape to another. Its GEMM model against measured GEMMs at the eleven
per-rank shapes of docs/PERFORMANCE.md's H100 table ("The GEMM model holds": +3.0% to
+17.1%) has a standard deviation of 4.2% around its median, so steps closer than ~5% are
inside what the model can tell apart. (Its documented accuracy against published runs,
15% for the SC21 table and 25% for the H100 rows, is mostly a shift shared by every layout
of one model, which does not reorder them.)"""

_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def model_parallel_ranks(layout: Layout) -> int:
    """The ranks one micro-batch passes through: tp x pp x cp."""
    return layout.tp * layout.pp * layout.cp


def _step(candidate: Candidate) -> float:
    assert candidate.plan is not None
    return candidate.plan.cost.step


def rank_with_ties(ranked: Sequence[Candidate], tolerance: float = TIE_TOLERANCE
                   ) -> List[Tuple[int, Candidate]]:
    """(tie group, layout) in the order to show: fastest first, where the fastest layout
    not yet placed opens a group that every layout within `tolerance` of its step joins;
    within a group, fewer model-parallel ranks first, then less memory, then faster."""
    groups: List[Tuple[int, Candidate]] = []
    group, anchor = -1, 0.0
    for candidate in sorted(ranked, key=_step):
        if group < 0 or _step(candidate) > anchor * (1 + tolerance):
            group, anchor = group + 1, _step(candidate)
        groups.append((group, candidate))
    return sorted(groups, key=lambda gc: (gc[0], model_parallel_ranks(gc[1].layout),
                                          gc[1].plan.peak_bytes if gc[1].plan else 0.0,
                                          _step(gc[1])))


@dataclass(frozen=True)
class RefusalGroup:
    """Layouts refused for the same reason (the same words, whatever the numbers)."""

    count: int
    example: Candidate  # the first layout refused so


def refusal_groups(refused: Sequence[Candidate]) -> List[RefusalGroup]:
    """One group per reason with its numbers as N (out of memory at any stage and size is
    one reason), the most common first."""
    counts: Dict[str, int] = {}
    first: Dict[str, Candidate] = {}
    for candidate in refused:
        key = _NUMBER.sub("N", candidate.reason or "")
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, candidate)
    order = sorted(counts, key=lambda k: -counts[k])  # stable: first seen first on a tie
    return [RefusalGroup(counts[k], first[k]) for k in order]
