"""Topology: pure rank math checked exhaustively, then live groups on forked gloo ranks."""
import itertools
import subprocess
import sys

import pytest
import torch

from gigatron.parallel import comm
from gigatron.parallel.topology import AXES, ProcessGroups, Topology
from multirank import run_on_ranks

ORDERS = ("tp-dp-pp", "tp-pp-dp", "pp-dp-tp")
AXIS_SETS = ["-".join(c) for n in (1, 2, 3) for c in itertools.combinations(AXES, n)]


def factorisations(world: int):
    """Every (tp, dp, pp) whose product is `world`."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp, pp in itertools.product(divisors, repeat=2):
        if world % (tp * pp) == 0:
            yield tp, world // (tp * pp), pp


def check_layout(topo: Topology) -> None:
    world = topo.world_size
    for rank in range(world):
        assert topo.rank(**topo.coords(rank)) == rank
    single = {axis: topo.groups(axis) for axis in AXES}
    for axes in AXIS_SETS:
        groups = topo.groups(axes) if "-" in axes else single[axes]
        size = topo.size(axes)
        assert all(len(g) == size for g in groups), axes
        assert sorted(r for g in groups for r in g) == list(range(world)), axes
        if "-" not in axes:
            continue
        # a combined group is the union of the single-axis groups of its members
        first, *rest = axes.split("-")
        for g in groups:
            members = set(next(h for h in single[first] if h[0] in g))
            for axis in rest:
                members = {r for m in members for r in next(h for h in single[axis] if m in h)}
            assert members == set(g), (axes, g)


@pytest.mark.parametrize("order", ORDERS)
def test_every_factorisation_of_1_to_64_partitions_ranks_consistently(order):
    layouts = 0
    for world in range(1, 65):
        for tp, dp, pp in factorisations(world):
            check_layout(Topology(tp=tp, dp=dp, pp=pp, order=order))
            layouts += 1
    assert layouts > 400  # the loop really covered the factorisations


def test_known_layout_world16_tp2_dp4_pp2():
    topo = Topology(tp=2, dp=4, pp=2)
    assert topo.group_of(0, "tp") == [0, 1]
    assert topo.group_of(0, "dp") == [0, 2, 4, 6]
    assert topo.group_of(0, "pp") == [0, 8]
    assert topo.group_of(0, "tp-pp") == [0, 1, 8, 9]
    assert topo.group_of(0, "tp-dp") == list(range(8))
    assert topo.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert topo.coords(13) == {"tp": 1, "dp": 2, "pp": 1}


def test_order_puts_dp_outermost_when_asked():
    topo = Topology(tp=2, dp=2, pp=2, order="tp-pp-dp")
    assert topo.group_of(0, "pp") == [0, 2]
    assert topo.group_of(0, "dp") == [0, 4]


def test_group_of_agrees_with_groups():
    topo = Topology(tp=2, dp=3, pp=2)
    for axes in AXIS_SETS:
        for g in topo.groups(axes):
            for r in g:
                assert topo.group_of(r, axes) == g


def test_embedding_groups_are_first_and_last_stage():
    topo = Topology(tp=2, dp=2, pp=4)
    assert topo.embedding_groups()[0] == [0, 12]
    assert topo.group_of(0, "pp") == [0, 4, 8, 12]
    single_stage = Topology(tp=2, dp=2, pp=1)
    assert single_stage.embedding_groups() == [[0], [1], [2], [3]]


def test_dp_is_derived_from_world_size():
    topo = Topology.from_world_size(32, tp=2, pp=2)
    assert (topo.dp, topo.world_size) == (8, 32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tp=2, pp=2), "world size 6 is not divisible by tensor x "
                                     "pipeline = 2 x 2 = 4"),
    (dict(world_size=8, tp=0), "tp must be a positive integer, got 0"),
    (dict(world_size=8, pp=-2), "pp must be a positive integer, got -2"),
    (dict(world_size=8, order="tp-dp-pp-xx"), "unknown axis ['xx']"),
    (dict(world_size=8, order="tp-ep-dp-pp"), "unknown axis ['ep']"),
    (dict(world_size=8, order="tp-dp"), "must name each of tp, dp, pp exactly once"),
])
def test_bad_sizes_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError) as err:
        Topology.from_world_size(**kwargs)
    assert message in str(err.value)


def test_cli_prints_layout():
    out = subprocess.run(
        [sys.executable, "-m", "gigatron", "topology", "--world-size", "16", "--tp", "2",
         "--pp", "2"], capture_output=True, text=True, check=True).stdout
    assert "tp=2 dp=4 pp=2" in out
    assert "  13 tp=1 dp=2 pp=1" in out
    assert "tp-pp groups (size 4):\n  [0, 1, 8, 9]" in out


def test_cli_rejects_bad_sizes_with_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "gigatron", "topology", "--world-size", "6", "--tp", "4"],
        capture_output=True, text=True)
    assert proc.returncode == 2
    assert "world size 6 is not divisible" in proc.stderr
    assert "Traceback" not in proc.stderr


def _allreduce_rank_over_every_group(rank, world_size):
    topo = Topology.from_world_size(world_size, tp=2, pp=2)
    groups = ProcessGroups(topo, rank)
    sums = {}
    for name in ("tp", "pp", "dp", "tp-pp", "embedding"):
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=groups[name])
        sums[name] = (t.item(), groups.ranks(name))
    return sums


def test_live_groups_tp2_pp2_dp2_sum_exactly_their_ranks():
    results = run_on_ranks(_allreduce_rank_over_every_group, 8)
    topo = Topology(tp=2, dp=2, pp=2)
    for rank, sums in enumerate(results):
        for name, (total, ranks) in sums.items():
            expected = topo.group_of(rank, name) if name != "embedding" else \
                next(g for g in topo.embedding_groups() if rank in g)
            assert ranks == expected, (rank, name)
            assert total == sum(expected), (rank, name)
