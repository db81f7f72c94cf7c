"""--cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes A P (issue 28).

- The sub-groups equal Megatron-Core's create_hierarchical_groups (a2a: A consecutive cp
  ranks; p2p: the ranks A apart), for several layouts.
- The inner group's gathered pieces, put in the coarse order, are exactly the ring's
  load-balanced piece of a split over P ranks (what makes the outer ring exact).
- One attention call at cp4 = 2 x 2 on forked gloo ranks, through the ProcessGroups that
  create and register the sub-groups: output and grads of q, k, v equal one unsplit SDPA
  call within 1e-5 (MHA and GQA, causal; and non-causal).
- Training at cp4 = 2 x 2 equal to one rank: tests/test_context_parallel.py's layout
  cp4_a2a_p2p_2x2 (it shares that file's one-rank reference).
- Bad sizes get one line naming the flag.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from gigatron.parallel.context.hierarchical import coarse_order_index
from gigatron.parallel.context.split import restore_sequence, split_for_rank
from gigatron.parallel.topology import Topology
from multirank import run_on_ranks
from test_context_attention import HEADS, inputs, reference
from test_context_parallel import GPT


@pytest.mark.parametrize("tp, cp, sizes", [(1, 4, (2, 2)), (2, 4, (2, 2)), (1, 8, (2, 4)),
                                           (1, 8, (4, 2)), (2, 4, (1, 4))])
def test_sub_groups_equal_megatron_cores_hierarchical_groups(monkeypatch, tp, cp, sizes):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns that Apex / TE are missing
        from megatron.core import parallel_state
    created = []
    monkeypatch.setattr(parallel_state, "create_group",
                        lambda ranks, **kw: created.append(list(ranks)))
    topology = Topology.from_world_size(tp * cp * 2, tp=tp, cp=cp)
    want_inner, want_outer = [], []
    for ranks in topology.groups("cp"):
        created.clear()
        parallel_state.create_hierarchical_groups(ranks[0], ranks, list(sizes))
        count = cp // sizes[0]
        want_inner += created[:count]
        want_outer += created[count:]
    assert topology.hierarchical_cp_groups(sizes) == (want_inner, want_outer)


@pytest.mark.parametrize("inner, outer", [(2, 2), (2, 3), (4, 2), (1, 4), (3, 1)])
def test_inner_group_pieces_in_coarse_order_are_the_rings_split(inner, outer):
    cp = inner * outer
    x = torch.arange(4 * cp * 3).view(1, 4 * cp * 3)
    local = x.shape[1] // cp
    order = coarse_order_index(local, inner)
    for k in range(outer):
        gathered = torch.cat([split_for_rank(x, cp, k * inner + i, seq_dim=1)
                              for i in range(inner)], dim=1)
        assert torch.equal(gathered[:, order], split_for_rank(x, outer, k, seq_dim=1))


def _attention(rank, world, cases):
    from gigatron.parallel.context.attention import context_parallel_attention
    from gigatron.parallel.topology import ProcessGroups

    groups = ProcessGroups(Topology.from_world_size(world, cp=world), rank,
                           hierarchical_cp=(2, world // 2))
    results = {}
    for kv_heads, causal in cases:
        q, k, v, grad_out = (split_for_rank(t, world, rank, seq_dim=2)
                             for t in inputs(kv_heads))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(q, k, v, groups.cp_group, "a2a+p2p", causal=causal)
        out.backward(grad_out)
        results[kv_heads, causal] = [out.detach(), q.grad, k.grad, v.grad]
    return results


def test_cp4_as_2x2_attention_matches_unsplit_sdpa():
    cases = [(HEADS, True), (HEADS // 2, True), (HEADS // 2, False)]
    per_rank = run_on_ranks(_attention, 4, cases)
    for case in cases:
        want = reference(case[0], causal=case[1])
        for i, name in enumerate(("out", "dq", "dk", "dv")):
            got = restore_sequence([r[case][i] for r in per_rank], seq_dim=2)
            err = (got - want[i]).abs().max().item()
            assert err < 1e-5, f"{case}: {name} differs by {err:.2e}"


@pytest.mark.parametrize("flags, message", [
    ("--cp-comm-type a2a+p2p --context-parallel-size 4",
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P"),
    ("--cp-comm-type a2a+p2p --context-parallel-size 4 "
     "--hierarchical-context-parallel-sizes 2 1",
     "--hierarchical-context-parallel-sizes 2 1: the product 2 must equal "
     "--context-parallel-size 4"),
    ("--cp-comm-type a2a+p2p --context-parallel-size 4 --num-attention-heads 2 "
     "--hierarchical-context-parallel-sizes 4 1",
     "--num-attention-heads 2 / --tensor-model-parallel-size 1 = 2 is not divisible by the "
     "a2a size 4 of --hierarchical-context-parallel-sizes"),
])
def test_bad_hierarchical_sizes_get_one_line_naming_the_flag(flags, message):
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.validation import ConfigError

    with pytest.raises(ConfigError) as err:
        parse_args(GPT + flags.split(), 4)
    assert any(message in line and "\n" not in line for line in err.value.problems), \
        err.value.problems


@pytest.mark.parametrize("heads, groups, sizes, flag", [
    (6, 6, (4, 1), "--num-attention-heads 6 is not divisible by the a2a size 4"),
    (8, 2, (4, 1), "--num-query-groups 2 is not divisible by the a2a size 4"),
    (8, 8, (2, 3), "--hierarchical-context-parallel-sizes 2 3: the product 6"),
    (8, 8, None, "needs --hierarchical-context-parallel-sizes A P"),
])
def test_attention_call_checks_the_sizes_and_heads_in_one_line(heads, groups, sizes, flag):
    from gigatron.parallel.context.split import check_context_parallel

    with pytest.raises(ValueError) as err:
        check_context_parallel(32, 4, heads, groups, "a2a+p2p", sizes)
    assert flag in str(err.value) and "\n" not in str(err.value)
    check_context_parallel(32, 4, 8, 2, "a2a+p2p", (2, 2))
