"""Expert view of the ranks: the same groups as Megatron-Core's RankGenerator, clear errors
for bad sizes, live groups on forked gloo ranks, and the CLI printing both views."""
import itertools
import warnings

import pytest
import torch

from gigatron.parallel import comm
from gigatron.parallel.expert.topology import EXPERT_GROUPS, ExpertTopology
from gigatron.parallel.topology import ProcessGroups, Topology, main as topology_main
from multirank import run_on_ranks

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # megatron-core warns that Apex / TE are missing
    from megatron.core.parallel_state import RankGenerator

# our group name -> Megatron-Core's token in its expert RankGenerator
MEGATRON_TOKEN = {"ep": "ep", "etp": "tp", "edp": "dp", "etp-ep": "tp-ep", "pp": "pp",
                  "etp-ep-pp": "tp-ep-pp"}


def megatron_expert_generator(expert: ExpertTopology) -> RankGenerator:
    """Megatron-Core's expert rank generator for the same layout (ep right before dp)."""
    order = expert.dense.order.replace("dp", "ep-dp")
    return RankGenerator(tp=expert.etp, ep=expert.ep, dp=expert.edp, pp=expert.pp, cp=1,
                         order=order)


def expert_layouts(world: int, order: str):
    """Every (dense topology, ep, etp) over `world` ranks that divides evenly."""
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp, pp in itertools.product(divisors, repeat=2):
        if world % (tp * pp):
            continue
        dense = Topology(tp=tp, dp=world // (tp * pp), pp=pp, order=order)
        stage = tp * dense.dp
        for ep, etp in itertools.product(divisors, repeat=2):
            if stage % (ep * etp) == 0:
                yield dense, ep, etp


@pytest.mark.parametrize("order", ["tp-dp-pp", "tp-pp-dp"])
def test_expert_groups_equal_megatron_rank_generator(order):
    checked = rejected = 0
    for world in (1, 2, 4, 6, 8, 12, 16, 24):
        for dense, ep, etp in expert_layouts(world, order):
            ours_ok = True
            try:
                expert = ExpertTopology(dense, ep=ep, etp=etp)
            except ValueError as err:
                assert "pipeline groups" in str(err)
                ours_ok = False
            mc = RankGenerator(tp=etp, ep=ep, dp=dense.tp * dense.dp // (ep * etp), pp=dense.pp,
                               cp=1, order=order.replace("dp", "ep-dp"))
            dense_pp = RankGenerator(tp=dense.tp, ep=1, dp=dense.dp, pp=dense.pp, cp=1,
                                     order=order).get_ranks("pp")
            # Megatron-Core asserts the expert and dense pipeline groups agree; so do we
            assert ours_ok == (mc.get_ranks("pp") == dense_pp), (dense, ep, etp)
            if not ours_ok:
                rejected += 1
                continue
            for name, token in MEGATRON_TOKEN.items():
                assert expert.groups(name) == mc.get_ranks(token), (dense, ep, etp, name)
            checked += 1
    assert checked > 150 and (rejected > 0) == (order == "tp-pp-dp")


def test_known_layout_world8_tp2_ep2_etp1():
    expert = ExpertTopology(Topology(tp=2, dp=4), ep=2, etp=1)
    assert expert.edp == 4
    assert expert.groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert expert.groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert expert.groups("etp") == [[r] for r in range(8)]
    assert expert.coords(5) == {"etp": 0, "ep": 1, "edp": 2, "pp": 0}


def test_default_etp_is_tp_and_etp_groups_equal_tp_groups():
    dense = Topology(tp=2, dp=4, pp=2)
    expert = ExpertTopology(dense, ep=2)
    assert expert.etp == 2 and expert.edp == 2
    assert expert.groups("etp") == dense.groups("tp")
    assert expert.groups("etp-ep") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                       [12, 13, 14, 15]]
    for rank in range(16):
        assert expert.group_of(rank, "edp") in expert.groups("edp")


@pytest.mark.parametrize("kwargs, message", [
    (dict(dense=Topology(tp=2, dp=4), ep=3), "expert tensor x expert model parallel = 2 x 3 = 6 "
                                            "does not divide the 8 ranks"),
    (dict(dense=Topology(tp=2, dp=2, pp=2), ep=4, etp=2), "= 2 x 4 = 8 does not divide the 4"),
    (dict(dense=Topology(tp=2, dp=4), ep=0), "--expert-model-parallel-size must be a positive"),
    (dict(dense=Topology(tp=2, dp=4), ep=2, etp=0), "--expert-tensor-parallel-size must be a "
                                                    "positive"),
    (dict(dense=Topology(tp=2, dp=2, pp=2, order="tp-pp-dp"), ep=2, etp=1),
     "would change the pipeline groups"),
])
def test_bad_expert_sizes_raise_one_line_naming_the_flags(kwargs, message):
    with pytest.raises(ValueError) as err:
        ExpertTopology(**kwargs)
    text = str(err.value)
    assert message in text and "\n" not in text
    assert "--expert-model-parallel-size" in text or "--expert-tensor-parallel-size" in text


def test_num_experts_must_divide_by_ep():
    expert = ExpertTopology(Topology(dp=4), ep=4)
    expert.check_num_experts(8)
    with pytest.raises(ValueError, match="--num-experts 6 is not divisible by "
                                         "--expert-model-parallel-size 4"):
        expert.check_num_experts(6)


def test_cli_prints_dense_and_expert_views(capsys):
    assert topology_main(["--world-size", "8", "--tp", "2", "--ep", "2", "--etp", "1"]) == 0
    out = capsys.readouterr().out
    assert "tp=2 dp=4 pp=1" in out and "tp groups (size 2):\n  [0, 1]" in out
    assert "expert layers: etp=1 ep=2 edp=4 pp=1" in out
    assert "edp groups (size 4):\n  [0, 2, 4, 6]\n  [1, 3, 5, 7]" in out
    assert topology_main(["--world-size", "8", "--tp", "2"]) == 0
    assert "expert layers" not in capsys.readouterr().out


def test_cli_rejects_bad_expert_sizes_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        topology_main(["--world-size", "8", "--tp", "2", "--ep", "3"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--expert-model-parallel-size" in err and err.count("\n") == 1


def _sum_rank_over_expert_groups(rank, world_size, with_expert):
    dense = Topology.from_world_size(world_size, tp=2)
    expert = ExpertTopology(dense, ep=2, etp=1) if with_expert else None
    groups = ProcessGroups(dense, rank, expert=expert)
    if not with_expert:
        return sorted(groups._groups)
    sums = {}
    for name in EXPERT_GROUPS:
        t = torch.tensor([float(rank)])
        comm.all_reduce(t, group=groups[name])
        sums[name] = (t.item(), groups.ranks(name))
    return sums


def test_live_expert_groups_sum_exactly_their_ranks_and_dense_jobs_create_none():
    results = run_on_ranks(_sum_rank_over_expert_groups, 8, True)
    expert = ExpertTopology(Topology(tp=2, dp=4), ep=2, etp=1)
    for rank, sums in enumerate(results):
        for name in EXPERT_GROUPS:
            members = expert.group_of(rank, name)
            assert sums[name] == (float(sum(members)), members), (rank, name)
    dense_names = run_on_ranks(_sum_rank_over_expert_groups, 4, False)
    assert not set(dense_names[0]) & set(EXPERT_GROUPS)
