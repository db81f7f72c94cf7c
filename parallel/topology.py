"""Process-group topology: which rank does what along tp, cp, dp and pp.

`Topology` is pure rank math over a grid (no I/O, no torch): rank <-> coordinates and the
rank lists of any axis or combination of axes. `ProcessGroups` creates the torch groups for
the current rank once, and modules receive the groups they need explicitly.

Run `gigatron topology --world-size 16 --tp 2 --pp 2` to print a layout (add `--cp 2` for
context parallelism, `--ep 2` for the expert layers' view, parallel/expert/topology.py).

The context-parallel axis cp sits between tp and dp as in Megatron-Core's default order
"tp-cp-ep-dp-pp". An order that does not name cp gets it right before dp when cp > 1; with
cp == 1 and no cp in the order the grid is exactly the tp x dp x pp one (same coordinates, same
groups), so dense layouts are unchanged. The cp ranks share the model and split the sequence:
gradients of shared parameters are reduced over "dp-cp".
"""
from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple, cast

from gigatron.parallel.activity import activity

if TYPE_CHECKING:
    from gigatron.parallel.comm import Group
    from gigatron.parallel.expert.topology import ExpertTopology

AXES = ("tp", "cp", "dp", "pp")
REQUIRED_AXES = ("tp", "dp", "pp")
DEFAULT_ORDER = "tp-dp-pp"

# Groups every training job needs; callers may ask for more combinations.
STANDARD_GROUPS = ("tp", "dp", "pp", "tp-pp")
# What a context-parallel job adds: the sequence split, the ranks sharing the model's gradients
# (dp-cp) and the ranks of one pipeline stage's model replica (tp-cp).
CONTEXT_GROUPS = ("cp", "dp-cp", "tp-cp")


def _parse_axes(spec: str, what: str) -> Tuple[str, ...]:
    axes = tuple(a for a in spec.split("-") if a)
    unknown = [a for a in axes if a not in AXES]
    if unknown or not axes:
        raise ValueError(
            f"{what} {spec!r} names unknown axis {unknown or spec!r}: use axes from "
            f"{'/'.join(AXES)} joined by '-', e.g. 'tp-pp'")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{what} {spec!r} repeats an axis: name each axis once")
    return axes


@dataclass(frozen=True)
class Topology:
    """A grid of ranks over axes tp, cp, dp, pp; the leftmost axis of `order` varies fastest."""

    tp: int = 1
    dp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER
    cp: int = 1
    _axes: Tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{axis} size must be a positive integer, got {size!r}")
        axes = _parse_axes(self.order, "order")
        if sorted(a for a in axes if a != "cp") != sorted(REQUIRED_AXES):
            raise ValueError(
                f"order {self.order!r} must name each of {', '.join(REQUIRED_AXES)} exactly "
                f"once (cp optional), e.g. 'tp-cp-dp-pp'")
        if "cp" not in axes and self.cp > 1:
            at = axes.index("dp")
            axes = axes[:at] + ("cp",) + axes[at:]
        object.__setattr__(self, "_axes", axes)

    @classmethod
    def from_world_size(cls, world_size: int, tp: int = 1, pp: int = 1,
                        order: str = DEFAULT_ORDER, cp: int = 1) -> "Topology":
        """Derive dp = world / (tp*cp*pp), as Megatron does from the launch size."""
        for name, size in (("world size", world_size), ("tp", tp), ("pp", pp), ("cp", cp)):
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        model = tp * cp * pp
        if world_size % model:
            if cp == 1:
                raise ValueError(
                    f"world size {world_size} is not divisible by tensor x pipeline = "
                    f"{tp} x {pp} = {model}: launch a multiple of {model} ranks or change "
                    f"--tensor-model-parallel-size / --pipeline-model-parallel-size")
            raise ValueError(
                f"world size {world_size} is not divisible by tensor x context x pipeline = "
                f"{tp} x {cp} x {pp} = {model}: launch a multiple of {model} ranks or change "
                f"--tensor-model-parallel-size / --context-parallel-size / "
                f"--pipeline-model-parallel-size")
        return cls(tp=tp, dp=world_size // model, pp=pp, order=order, cp=cp)

    @property
    def axes(self) -> Tuple[str, ...]:
        """Axes from fastest- to slowest-varying."""
        return self._axes

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def size(self, axes: str) -> int:
        """Number of ranks in one group of `axes` (e.g. 'tp-pp')."""
        total = 1
        for axis in _parse_axes(axes, "axes"):
            total *= getattr(self, axis)
        return total

    def coords(self, rank: int) -> Dict[str, int]:
        """This rank's index along each axis."""
        self._check_rank(rank)
        out = {}
        for axis in self._axes:
            size = getattr(self, axis)
            out[axis] = rank % size
            rank //= size
        return out

    def rank(self, **coords: int) -> int:
        """The rank at the given coordinates (axes not given count as 0)."""
        unknown = set(coords) - set(AXES)
        if unknown:
            raise ValueError(f"unknown axis {sorted(unknown)}: use {', '.join(AXES)}")
        if coords.get("cp", 0) and "cp" not in self._axes:
            raise ValueError(f"cp index {coords['cp']} is outside 0..0")
        rank, stride = 0, 1
        for axis in self._axes:
            size, index = getattr(self, axis), coords.get(axis, 0)
            if not 0 <= index < size:
                raise ValueError(f"{axis} index {index} is outside 0..{size - 1}")
            rank += index * stride
            stride *= size
        return rank

    def groups(self, axes: str) -> List[List[int]]:
        """All rank groups along `axes`: ranks that differ only in those coordinates."""
        varying = _parse_axes(axes, "axes")
        fixed = [a for a in self._axes if a not in varying]
        by_key: Dict[Tuple[int, ...], List[int]] = {}
        for rank in range(self.world_size):
            c = self.coords(rank)
            by_key.setdefault(tuple(c[a] for a in fixed), []).append(rank)
        return sorted(by_key.values())

    def group_of(self, rank: int, axes: str) -> List[int]:
        """The ranks of `rank`'s group along `axes`."""
        self._check_rank(rank)
        c = self.coords(rank)
        varying = _parse_axes(axes, "axes")
        ranges = [range(getattr(self, a)) if a in varying else [c[a]] for a in self._axes]
        return sorted(self.rank(**dict(zip(self._axes, point)))
                      for point in itertools.product(*ranges))

    def embedding_groups(self) -> List[List[int]]:
        """First and last pipeline stage of each pipeline group (they share tied embeddings)."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    def hierarchical_cp_groups(self, sizes: Sequence[int]) -> Tuple[List[List[int]],
                                                                     List[List[int]]]:
        """(inner, outer) sub-groups of every cp group for --hierarchical-context-parallel-
        sizes A P, as Megatron-Core's create_hierarchical_parallel_groups: inner groups of A
        consecutive cp ranks (a2a), outer groups of the ranks A apart (p2p)."""
        inner_size, outer_size = sizes
        if inner_size * outer_size != self.cp:
            raise ValueError(f"--hierarchical-context-parallel-sizes {inner_size} {outer_size}:"
                             f" the product must equal --context-parallel-size {self.cp}")
        inner: List[List[int]] = []
        outer: List[List[int]] = []
        for ranks in self.groups("cp"):
            inner += [ranks[k * inner_size:(k + 1) * inner_size] for k in range(outer_size)]
            outer += [ranks[j::inner_size] for j in range(inner_size)]
        return inner, outer

    def describe(self) -> str:
        """The whole layout as text: each rank's coordinates, then each group's ranks."""
        shown = [a for a in AXES if a in self._axes]
        sizes = " ".join(f"{a}={getattr(self, a)}" for a in shown)
        lines = [f"world size {self.world_size}: {sizes}, "
                 f"order {'-'.join(self._axes)} (leftmost varies fastest)", "", "rank coords"]
        for r in range(self.world_size):
            c = self.coords(r)
            lines.append(f"{r:4d} " + " ".join(f"{a}={c[a]}" for a in shown))
        for axes in STANDARD_GROUPS + (CONTEXT_GROUPS if "cp" in self._axes else ()):
            lines += ["", f"{axes} groups (size {self.size(axes)}):"]
            lines += [f"  {g}" for g in self.groups(axes)]
        lines += ["", "embedding groups (first + last pipeline stage):"]
        lines += [f"  {g}" for g in self.embedding_groups()]
        return "\n".join(lines)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside 0..{self.world_size - 1}")


class ProcessGroups:
    """The torch process groups of one rank, created once, handed to modules explicitly.

    Every rank calls `new_group` for every group in the same order (torch requires it);
    each rank keeps the groups it belongs to. Access: `groups.tp`, `groups["tp-pp"]`.
    `timeout` is every group's collective timeout (torch gives subgroups its own default,
    30 min for gloo, not the world group's): pass --distributed-timeout-minutes here.
    `expert` (an ExpertTopology over `topology`) also creates the expert groups "ep", "etp",
    "edp" and "etp-ep"; dense jobs leave it out and create none of them.
    `hierarchical_cp` (--hierarchical-context-parallel-sizes A P) adds "cp-a2a" and "cp-p2p".
    """

    def __init__(self, topology: Topology, rank: int,
                 extra: Sequence[str] = (), backend: Optional[str] = None,
                 timeout: Optional[timedelta] = None, expert: Optional["ExpertTopology"] = None,
                 hierarchical_cp: Optional[Sequence[int]] = None) -> None:
        import torch.distributed as dist  # the pure part above stays importable without torch

        if dist.get_world_size() != topology.world_size:
            raise ValueError(
                f"the job has {dist.get_world_size()} ranks but the topology needs "
                f"tp*cp*dp*pp = {topology.world_size}: fix the parallel sizes or the launch")
        self.topology = topology
        self.rank = rank
        self.coords = topology.coords(rank)
        self._groups: Dict[str, object] = {}
        self._ranks: Dict[str, List[int]] = {}
        self.timeout = timeout
        context = CONTEXT_GROUPS if topology.cp > 1 else ()
        names = list(dict.fromkeys(list(STANDARD_GROUPS) + list(context) + list(extra)))
        for name in names:
            self._create(dist, name, topology.groups(name), backend)
        if topology.cp == 1:  # without cp the model is shared by dp alone: no extra groups
            for name, same in (("dp-cp", "dp"), ("tp-cp", "tp")):
                self._groups.setdefault(name, self._groups[same])
                self._ranks.setdefault(name, self._ranks[same])
        self._create(dist, "embedding", topology.embedding_groups(), backend)
        self._create(dist, "position_embedding",
                     [[g[0]] for g in topology.groups("pp")], backend)
        if hierarchical_cp is not None and topology.cp > 1:
            self._create_hierarchical_cp(dist, hierarchical_cp, backend)
        self.expert = expert
        if expert is not None:
            from gigatron.parallel.expert.topology import EXPERT_GROUPS

            if expert.dense != topology:
                raise ValueError(f"the expert topology is over {expert.dense}, the job's is "
                                 f"{topology}: build ExpertTopology from the same Topology")
            for name in EXPERT_GROUPS:
                self._create(dist, name, expert.groups(name), backend)

    def _create(self, dist, name: str, groups: List[List[int]], backend: Optional[str]) -> None:
        for ranks in groups:
            group = dist.new_group(ranks, backend=backend, timeout=self.timeout)
            if self.rank in ranks:
                self._groups[name], self._ranks[name] = group, ranks
                activity.label_group(group, f"{name} group {ranks}")
        self._ranks.setdefault(name, [])

    def _create_hierarchical_cp(self, dist, sizes: Sequence[int], backend: Optional[str]
                                ) -> None:
        """The a2a (inner) and p2p (outer) groups of --cp-comm-type a2a+p2p, registered for
        the attention under this rank's cp group."""
        from gigatron.parallel.context.hierarchical import register_subgroups

        inner, outer = self.topology.hierarchical_cp_groups(sizes)
        self._create(dist, "cp-a2a", inner, backend)
        self._create(dist, "cp-p2p", outer, backend)
        register_subgroups(*(cast("Group", self._groups[name])
                             for name in ("cp", "cp-a2a", "cp-p2p")))

    def __getitem__(self, name: str):
        if name not in self._groups:
            raise KeyError(f"no process group {name!r} for rank {self.rank}; created: "
                           f"{sorted(self._groups)}")
        return self._groups[name]

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        groups = self.__dict__.get("_groups", {})
        if name in groups:
            return groups[name]
        raise AttributeError(f"no process group {name!r}; created: {sorted(groups)}")

    @property
    def cp_group(self) -> "Group":
        """The context-parallel group, or None when the job has no context parallelism."""
        return cast("Group", self._groups.get("cp")) if self.topology.cp > 1 else None

    def ranks(self, name: str) -> List[int]:
        """Global ranks of this rank's group `name` (empty if it is in none)."""
        return self._ranks[name]

    def size(self, name: str) -> int:
        return len(self._ranks[name])

    def index(self, name: str) -> int:
        """This rank's position in its group `name`."""
        return self._ranks[name].index(self.rank)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Print a layout (`gigatron topology`): each rank's coordinates and every group."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks")
    parser.add_argument("--tp", "--tensor-model-parallel-size", type=int, default=1, dest="tp",
                        help="tensor-parallel size (default: %(default)s)")
    parser.add_argument("--pp", "--pipeline-model-parallel-size", type=int, default=1,
                        dest="pp", help="pipeline-parallel size (default: %(default)s)")
    parser.add_argument("--cp", "--context-parallel-size", type=int, default=1, dest="cp",
                        help="context-parallel size (default: %(default)s)")
    parser.add_argument("--order", default=DEFAULT_ORDER,
                        help="axes from fastest- to slowest-varying rank index (default: %(default)s)")
    parser.add_argument("--ep", "--expert-model-parallel-size", type=int, default=1, dest="ep",
                        help="expert-parallel size; with --ep or --etp the expert layers' view "
                             "is printed too (default: %(default)s)")
    parser.add_argument("--etp", "--expert-tensor-parallel-size", type=int, default=None,
                        dest="etp", help="expert tensor-parallel size (default: --tp)")
    args = parser.parse_args(argv)
    from gigatron.parallel.expert.topology import ExpertTopology

    try:
        topo = Topology.from_world_size(args.world_size, tp=args.tp, pp=args.pp,
                                        order=args.order, cp=args.cp)
        expert = ExpertTopology(topo, ep=args.ep, etp=args.etp)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    print(topo.describe())
    if args.ep != 1 or args.etp is not None:
        print("\n" + expert.describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
