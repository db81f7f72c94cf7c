"""Expert-parallel token dispatch on forked gloo ranks equals one rank with every expert.

Each layout (ep2, ep4, ep2 x etp2) runs the all-to-all and the all-gather dispatcher on
tokens that differ per rank, with experts whose weights every rank knows (tanh MLPs; with
etp 2 each etp rank holds half of every expert's ffn), for routings with random top-2,
experts (and whole ranks) that get no token, and every token to one expert. The output, the
grads of the hidden states and router probabilities, and the local experts' weight grads
equal `LocalDispatcher` on the concatenated tokens, within fp32 summation's rounding
(`tolerance`: the summation order differs between one rank and the experts' ranks).
"""
import pytest
import torch

from gigatron.parallel import comm
from gigatron.parallel.expert.allgather import AllGatherDispatcher
from gigatron.parallel.expert.alltoall import AllToAllDispatcher
from gigatron.parallel.expert.dispatch import LocalDispatcher
from gigatron.parallel.expert.topology import ExpertTopology
from gigatron.parallel.topology import ProcessGroups, Topology
from multirank import run_on_ranks

NUM_EXPERTS, HIDDEN, FFN = 8, 8, 12
SCENARIOS = ("random_top2", "empty_experts", "all_to_one_expert")
DISPATCHERS = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
# (world, ep, etp); world = ep x etp, so one expert group sees every token
LAYOUTS = [(2, 2, 1), (4, 4, 1), (4, 2, 2)]


def tokens_per_rank(kind: str, world: int):
    """All-to-all takes uneven token counts (a rank may have none); all-gather equal ones."""
    if kind == "allgather":
        return [6] * world
    return {2: [6, 3], 4: [6, 0, 9, 4]}[world]


def routing(logits: torch.Tensor, scenario: str):
    """(probs [T, E] with zeros off the route, bool routing_map [T, E])."""
    logits, topk = logits.clone(), 2
    if scenario == "empty_experts":  # only experts 0 and 3: ranks holding 4..7 get nothing
        keep = torch.zeros(NUM_EXPERTS, dtype=torch.bool)
        keep[[0, 3]] = True
        logits[:, ~keep] = float("-inf")
    elif scenario == "all_to_one_expert":
        logits[:, -1] = 1e4
        topk = 1
    values, experts = logits.topk(topk, dim=-1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
    probs = torch.zeros_like(logits).scatter(1, experts, torch.softmax(values, dim=-1))
    return probs, routing_map


def run_experts(rows, tokens_per_expert, weight1, weight2):
    """tanh MLP per expert on expert-major rows (a partial output with an ffn slice)."""
    chunks = rows.split(tokens_per_expert.tolist())
    outs = [torch.tanh(chunk @ weight1[e]) @ weight2[e] for e, chunk in enumerate(chunks)]
    return torch.cat(outs) if outs else rows.new_zeros(0, weight2.shape[-1])


def forward_backward(dispatcher, hidden, probs, routing_map, weight1, weight2, grad_out):
    """Dispatch, run the experts, combine, backprop sum(out * grad_out); the dispatch too."""
    dispatched = dispatcher.dispatch(hidden, probs, routing_map)
    rows = run_experts(dispatched.rows, dispatched.tokens_per_expert, weight1, weight2)
    out = dispatcher.combine(rows, dispatched)
    (out * grad_out).sum().backward()
    return out.detach(), dispatched.tokens_per_expert.tolist()


def tolerance(reference: torch.Tensor, reduction_length: int) -> float:
    """Worst-case rounding of a sum of `reduction_length` terms in the reference's dtype,
    relative to its largest magnitude (at least 1): n * eps * max|x|. About 1e-5 at this file's
    sizes, against the O(1) errors a lost or misrouted token makes; an absolute 1e-6 missed on
    some CPUs (a weight grad 1.43e-6 off: a few ulps of a 19-token sum of magnitude ~5)."""
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    return reduction_length * torch.finfo(reference.dtype).eps * max(scale, 1.0)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _compare_with_one_rank(rank, world, kind, ep, etp):
    dense = Topology(tp=etp, dp=world // etp)
    expert = ExpertTopology(dense, ep=ep, etp=etp)
    groups = ProcessGroups(dense, rank, expert=expert)
    dispatcher = DISPATCHERS[kind](groups["ep"], NUM_EXPERTS, groups["etp"] if etp > 1 else None)
    coords, local = expert.coords(rank), NUM_EXPERTS // ep
    experts = slice(coords["ep"] * local, (coords["ep"] + 1) * local)
    ffn = slice(coords["etp"] * FFN // etp, (coords["etp"] + 1) * FFN // etp)
    counts = tokens_per_rank(kind, world)
    mine = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    gen = torch.Generator().manual_seed(1234)  # the same global tensors on every rank
    weight1 = torch.randn(NUM_EXPERTS, HIDDEN, FFN, generator=gen) / HIDDEN ** 0.5
    weight2 = torch.randn(NUM_EXPERTS, FFN, HIDDEN, generator=gen) / FFN ** 0.5
    results = {}
    for scenario in SCENARIOS:
        hidden_all = torch.randn(sum(counts), HIDDEN, generator=gen)
        probs_all, map_all = routing(torch.randn(sum(counts), NUM_EXPERTS, generator=gen),
                                     scenario)
        grad_out = torch.randn(sum(counts), HIDDEN, generator=gen)
        ref = [leaf(t) for t in (hidden_all, probs_all, weight1, weight2)]
        ref_out, _ = forward_backward(LocalDispatcher(NUM_EXPERTS), ref[0], ref[1], map_all,
                                      ref[2], ref[3], grad_out)
        ours = [leaf(hidden_all[mine]), leaf(probs_all[mine]),
                leaf(weight1[experts, :, ffn]), leaf(weight2[experts, ffn, :])]
        comm.stats.reset()
        out, tokens_per_expert = forward_backward(dispatcher, ours[0], ours[1], map_all[mine],
                                                  ours[2], ours[3], grad_out[mine])
        pairs = {"output": (out, ref_out[mine]),
                 "hidden grad": (ours[0].grad, ref[0].grad[mine]),
                 "probs grad": (ours[1].grad, ref[1].grad[mine]),
                 "weight1 grad": (ours[2].grad, ref[2].grad[experts, :, ffn]),
                 "weight2 grad": (ours[3].grad, ref[3].grad[experts, ffn, :])}
        # the longest sum behind any compared value: over every token (weight grads) or over
        # a hidden and an ffn row (outputs, input grads)
        reduction = sum(counts) + HIDDEN + FFN
        errors = {name: (tuple(a.shape) == tuple(b.shape) and float((a - b).abs().max())
                         if a.numel() else 0.0, tolerance(b, reduction))
                  for name, (a, b) in pairs.items()}
        others = torch.ones(sum(counts), dtype=torch.bool)
        others[mine] = False
        sent = int(map_all[mine].sum() - map_all[mine][:, experts].sum())
        received = int(map_all[others][:, experts].sum())
        results[scenario] = dict(errors=errors, tokens_per_expert=tokens_per_expert,
                                 a2a_bytes=comm.stats.bytes.get("all_to_all", 0),
                                 expected_a2a_bytes=2 * (sent + received) * HIDDEN * 4)
    return results


@pytest.mark.parametrize("kind", sorted(DISPATCHERS))
@pytest.mark.parametrize("world, ep, etp", LAYOUTS, ids=[f"ep{ep}_etp{etp}"
                                                         for _, ep, etp in LAYOUTS])
def test_dispatch_compute_combine_equals_one_rank_with_every_expert(kind, world, ep, etp):
    results = run_on_ranks(_compare_with_one_rank, world, kind, ep, etp, timeout=180)
    for rank, by_scenario in enumerate(results):
        for scenario, result in by_scenario.items():
            for name, (error, bound) in result["errors"].items():
                assert error is not False, f"rank {rank} {scenario}: {name} has the wrong shape"
                assert error <= bound, (f"rank {rank} {scenario}: {name} differs by {error:.2e} "
                                        f"(tolerance {bound:.2e})")
            if kind == "alltoall" and etp == 1:
                # dispatch sends this rank's rows for other ranks' experts, combine returns the
                # rows others sent here; backward repeats both with the splits swapped
                assert result["a2a_bytes"] == result["expected_a2a_bytes"], (rank, scenario)
    per_expert = [[count for r in results[::etp] for count in r[s]["tokens_per_expert"]]
                  for s in SCENARIOS]
    # the scenarios really covered empty experts and one busy expert
    assert per_expert[1].count(0) >= NUM_EXPERTS - 2 and per_expert[2].count(0) == NUM_EXPERTS - 1


def test_expert_count_must_divide_by_ep():
    from gigatron.parallel.comm import ShapeOnlyGroup

    with pytest.raises(ValueError, match="--num-experts 6 is not divisible by "
                                         "--expert-model-parallel-size 4"):
        AllToAllDispatcher(ShapeOnlyGroup(4, 1), 6)
    with pytest.raises(ValueError, match="--num-experts 6 is not divisible"):
        AllGatherDispatcher(ShapeOnlyGroup(4, 1), 6)
