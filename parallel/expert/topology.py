"""The expert layers' view of the ranks: etp x ep x edp over the ranks that tp x cp x dp cover.

Megatron-Core splits the ranks of one pipeline stage twice: dense layers into tp x dp (x cp),
expert layers into expert-tensor-parallel (etp, --expert-tensor-parallel-size, default tp) x
expert-parallel (ep, --expert-model-parallel-size) x expert-data-parallel (edp = tp*cp*dp /
(etp*ep)); pp is shared. The expert grid keeps the dense order with tp -> etp, cp folded away
and dp -> ep-edp (ep varies faster than edp), which is Megatron-Core's expert RankGenerator
(cp=1, "ep" right before "dp" in its order, "tp-cp-ep-dp-pp" by default): the same ranks form
the same groups.

Pure rank math like `Topology`; `ProcessGroups(..., expert=ExpertTopology(...))` creates the
groups "ep", "etp", "edp" and "etp-ep" (the expert model-parallel group).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from gigatron.parallel.topology import Topology

EXPERT_AXES = ("etp", "ep", "edp", "pp")
# the groups an expert-parallel job creates, in creation order (every rank the same)
EXPERT_GROUPS = ("ep", "etp", "edp", "etp-ep")
_FROM_DENSE = {"tp": ("etp",), "cp": (), "dp": ("ep", "edp"), "pp": ("pp",)}
_FLAGS = "--expert-model-parallel-size / --expert-tensor-parallel-size"


def _parse_axes(spec: str) -> Tuple[str, ...]:
    axes = tuple(a for a in spec.split("-") if a)
    unknown = [a for a in axes if a not in EXPERT_AXES]
    if unknown or not axes or len(set(axes)) != len(axes):
        raise ValueError(f"expert axes {spec!r}: name each of {'/'.join(EXPERT_AXES)} at most "
                         f"once, joined by '-', e.g. 'etp-ep'")
    return axes


@dataclass(frozen=True)
class ExpertTopology:
    """Expert-layer grid over the ranks of `dense`; etp None means the dense tp size."""

    dense: Topology
    ep: int = 1
    etp: Optional[int] = None
    edp: int = field(init=False)
    _axes: Tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        etp = self.dense.tp if self.etp is None else self.etp
        for flag, size in (("--expert-model-parallel-size", self.ep),
                           ("--expert-tensor-parallel-size", etp)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{flag} must be a positive integer, got {size!r}")
        stage = self.dense.tp * self.dense.cp * self.dense.dp
        if stage % (etp * self.ep):
            raise ValueError(
                f"expert tensor x expert model parallel = {etp} x {self.ep} = {etp * self.ep} "
                f"does not divide the {stage} ranks of a pipeline stage (tensor x context x "
                f"data parallel = {self.dense.tp} x {self.dense.cp} x {self.dense.dp}): change "
                f"{_FLAGS} or the launch size")
        object.__setattr__(self, "etp", etp)
        object.__setattr__(self, "edp", stage // (etp * self.ep))
        axes = tuple(a for dense_axis in self.dense.axes for a in _FROM_DENSE[dense_axis])
        object.__setattr__(self, "_axes", axes)
        if self.groups("pp") != self.dense.groups("pp"):
            raise ValueError(
                f"with order {self.dense.order!r} the expert layout etp={etp} ep={self.ep} "
                f"would change the pipeline groups: keep etp x ep = tp ({self.dense.tp}) or "
                f"put pp last in the order (as Megatron-Core requires); change {_FLAGS}")

    @property
    def axes(self) -> Tuple[str, ...]:
        """Expert axes from fastest- to slowest-varying."""
        return self._axes

    @property
    def pp(self) -> int:
        """Pipeline size, shared with the dense layers."""
        return self.dense.pp

    @property
    def world_size(self) -> int:
        return self.dense.world_size

    def size(self, axes: str) -> int:
        """Ranks in one group of `axes` (e.g. 'etp-ep')."""
        total = 1
        for axis in _parse_axes(axes):
            total *= getattr(self, axis)
        return total

    def coords(self, rank: int) -> Dict[str, int]:
        """This rank's index along each expert axis."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")
        out = {}
        for axis in self._axes:
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return out

    def groups(self, axes: str) -> List[List[int]]:
        """All rank groups along `axes`: ranks that differ only in those expert coordinates."""
        varying = _parse_axes(axes)
        fixed = [a for a in EXPERT_AXES if a not in varying]
        by_key: Dict[Tuple[int, ...], List[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            by_key.setdefault(tuple(c[a] for a in fixed), []).append(rank)
        return sorted(by_key.values())

    def group_of(self, rank: int, axes: str) -> List[int]:
        """The ranks of `rank`'s group along `axes`."""
        return next(g for g in self.groups(axes) if rank in g)

    def check_num_experts(self, num_experts: int) -> None:
        """Reject an expert count the ep ranks cannot share evenly."""
        if num_experts % self.ep:
            raise ValueError(f"--num-experts {num_experts} is not divisible by "
                             f"--expert-model-parallel-size {self.ep}: each expert-parallel "
                             f"rank holds num_experts / ep experts")

    def describe(self) -> str:
        """The expert view as text: each rank's expert coordinates, then each group's ranks."""
        lines = [f"expert layers: etp={self.etp} ep={self.ep} edp={self.edp} pp={self.pp}, "
                 f"order {'-'.join(self._axes)} (leftmost varies fastest)", "", "rank coords"]
        for r in range(self.world_size):
            c = self.coords(r)
            lines.append(f"{r:4d} " + " ".join(f"{a}={c[a]}" for a in EXPERT_AXES))
        for axes in EXPERT_GROUPS:
            lines += ["", f"{axes} groups (size {self.size(axes)}):"]
            lines += [f"  {g}" for g in self.groups(axes)]
        return "\n".join(lines)
