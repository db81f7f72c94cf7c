"""Context-parallel attention on forked gloo ranks equals one unsplit attention call.

For cp 2 and 4, each --cp-comm-type (p2p ring, all_gather, a2a), MHA and GQA, batch 2, fp32:
the local outputs and the grads of the local q, k, v, put back into global order, equal
torch's scaled_dot_product_attention on the whole sequence (causal) within 1e-5. The
load-balanced split is checked without processes: its pieces restore the sequence, every rank
gets the same causal work, and the ring's blocks tile each rank's causal mask exactly.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from gigatron.parallel import comm
from gigatron.parallel.context import kernels
from gigatron.parallel.context.all_gather import query_blocks
from gigatron.parallel.context.attention import context_parallel_attention
from gigatron.parallel.context.ring import block_slices
from gigatron.parallel.context.split import (check_context_parallel, rank_positions,
                                             restore_sequence, split_for_rank)
from multirank import run_on_ranks

BATCH, HEADS, SEQ, DIM = 2, 8, 32, 16
COMM_TYPES = ("p2p", "all_gather", "a2a")


def inputs(kv_heads: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen)
    k = torch.randn(BATCH, kv_heads, SEQ, DIM, generator=gen)
    v = torch.randn(BATCH, kv_heads, SEQ, DIM, generator=gen)
    grad_out = torch.randn(BATCH, HEADS, SEQ, DIM, generator=gen)
    return q, k, v, grad_out


def reference(kv_heads: int, causal: bool = True, seed: int = 0):
    """Output and grads of q, k, v of one unsplit SDPA call."""
    q, k, v, grad_out = inputs(kv_heads, seed)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                         enable_gqa=kv_heads != HEADS)
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _local_attention(rank, cp, cases):
    """Per case (comm type, kv heads, causal): this rank's output and q, k, v grads."""
    results = {}
    for comm_type, kv_heads, causal in cases:
        q, k, v, grad_out = (split_for_rank(t, cp, rank, seq_dim=2) for t in inputs(kv_heads))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(q, k, v, None, comm_type, causal=causal)
        out.backward(grad_out)
        results[comm_type, kv_heads, causal] = [out.detach(), q.grad, k.grad, v.grad]
    return results


def run_cases(cp, cases):
    """Each case's (output, dq, dk, dv) in global order, gathered from the cp ranks."""
    per_rank = run_on_ranks(_local_attention, cp, cases)
    return {case: [restore_sequence([r[case][i] for r in per_rank], seq_dim=2)
                   for i in range(4)] for case in cases}


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_unsplit_sdpa(cp):
    cases = [(c, kv, True) for c in COMM_TYPES for kv in (HEADS, HEADS // 2)]
    if cp == 2:
        cases += [(c, HEADS // 2, False) for c in COMM_TYPES]
    for case, got in run_cases(cp, cases).items():
        want = reference(case[1], causal=case[2])
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            err = (g - w).abs().max().item()
            assert err < 1e-5, f"cp{cp} {case}: {name} differs by {err:.2e}"


def test_ring_without_log_sum_exp_merge_is_wrong(monkeypatch):
    """Averaging the partial outputs instead of the LSE merge must fail the 1e-5 check."""
    def average(out, lse, block_out, block_lse):
        return (out + block_out.float()) / 2, torch.logaddexp(lse, block_lse)
    monkeypatch.setattr(kernels, "merge_partial", average)
    got = run_cases(2, [("p2p", HEADS, True)])["p2p", HEADS, True]
    err = (got[0] - reference(HEADS)[0]).abs().max().item()
    assert err > 1e-2, f"naive averaging matched the reference within {err:.2e}"


def _ring_traffic(rank, cp):
    """Bytes this rank sends in the ring's forward and backward."""
    q, k, v, grad_out = (split_for_rank(t, cp, rank, seq_dim=2) for t in inputs(HEADS // 2))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    comm.stats.reset()
    out = context_parallel_attention(q, k, v, None, "p2p")
    forward = comm.stats.bytes["send"]
    out.backward(grad_out)
    return forward, comm.stats.bytes["send"] - forward, 2 * k.numel() * k.element_size()


def test_ring_sends_kv_cp_minus_1_times_forward_and_kv_plus_grads_backward():
    """Forward: cp-1 hops of k and v; backward: cp-1 hops of k, v and cp of their grads."""
    cp = 4
    for forward, backward, kv_bytes in run_on_ranks(_ring_traffic, cp):
        assert forward == (cp - 1) * kv_bytes
        assert backward == (2 * cp - 1) * kv_bytes


def _in_subgroups(rank, world, cases):
    """Two cp groups of interleaved ranks ({0, 2} and {1, 3}): ring peers are global ranks."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_group, cp_rank = groups[rank % 2], rank // 2
    results = {}
    for comm_type, kv_heads, causal in cases:
        q, k, v, grad_out = (split_for_rank(t, 2, cp_rank, seq_dim=2)
                             for t in inputs(kv_heads, seed=rank % 2))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = context_parallel_attention(q, k, v, cp_group, comm_type, causal=causal)
        out.backward(grad_out)
        results[comm_type] = [out.detach(), q.grad, k.grad, v.grad]
    return results


def test_cp_groups_inside_a_larger_world_match_unsplit_sdpa():
    cases = [(c, HEADS // 2, True) for c in COMM_TYPES]
    per_rank = run_on_ranks(_in_subgroups, 4, cases)
    for seed in (0, 1):
        want = reference(HEADS // 2, seed=seed)
        for comm_type in COMM_TYPES:
            pieces = [per_rank[seed][comm_type], per_rank[seed + 2][comm_type]]
            for i, name in enumerate(("out", "dq", "dk", "dv")):
                got = restore_sequence([p[i] for p in pieces], seq_dim=2)
                err = (got - want[i]).abs().max().item()
                assert err < 1e-5, f"cp group {seed}, {comm_type}: {name} differs by {err:.2e}"


def test_single_rank_is_plain_attention():
    for comm_type in COMM_TYPES:
        got = _local_attention(0, 1, [(comm_type, HEADS // 2, True)])
        for g, w in zip(got[comm_type, HEADS // 2, True], reference(HEADS // 2)):
            assert (g - w).abs().max().item() < 1e-5, comm_type


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_dim", [0, 1])
def test_split_and_restore_are_inverse(cp, seq_dim):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3) if seq_dim == 1 else torch.arange(
        24 * 2 * 3).view(24, 2, 3)
    pieces = [split_for_rank(x, cp, r, seq_dim) for r in range(cp)]
    assert all(p.shape[seq_dim] == 24 // cp for p in pieces)
    assert torch.equal(restore_sequence(pieces, seq_dim), x)
    positions = torch.cat([rank_positions(24, cp, r) for r in range(cp)])
    assert torch.equal(positions.sort().values, torch.arange(24))
    for r, piece in enumerate(pieces):  # the positions are those of the split's tokens
        assert torch.equal(piece.select(1 - seq_dim, 0).select(-1, 0) // 3 % 24
                           if seq_dim == 1 else piece[:, 0, 0] // 6, rank_positions(24, cp, r))


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_load_balanced_split_gives_every_rank_equal_causal_work(cp):
    seq = 16 * cp
    work = [int((rank_positions(seq, cp, r) + 1).sum()) for r in range(cp)]  # unmasked scores
    assert len(set(work)) == 1, work
    plain = [int(torch.arange(r * seq // cp, (r + 1) * seq // cp).add(1).sum())
             for r in range(cp)]  # a contiguous split would not balance (sanity of the check)
    assert cp == 1 or len(set(plain)) == cp


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_ring_blocks_tile_each_ranks_causal_mask(cp):
    """The (query rows, key rows, causal) block of every source rank covers exactly the
    causal mask of the local queries, each allowed score once, and costs the same per step."""
    seq = 8 * cp
    local = seq // cp
    for rank in range(cp):
        queries = rank_positions(seq, cp, rank)
        covered = torch.zeros(local, seq, dtype=torch.int64)
        areas = set()
        for source in range(cp):
            rows, cols, causal = block_slices(rank, source, local, causal=True)
            keys = rank_positions(seq, cp, source)[cols]
            block = torch.ones(len(queries[rows]), len(keys), dtype=torch.int64)
            if causal:
                block = block.tril()
            covered.index_put_((torch.arange(local)[rows].unsqueeze(1), keys.unsqueeze(0)),
                               block, accumulate=True)
            if source != rank:
                areas.add(block.numel())
        want = (torch.arange(seq).unsqueeze(0) <= queries.unsqueeze(1)).long()
        assert torch.equal(covered, want), f"cp{cp} rank {rank}"
        assert len(areas) <= 1, areas


@pytest.mark.parametrize("args, flag", [
    ((30, 4, 8, 8, "p2p"), "--seq-length 30"),
    ((32, 4, 6, 6, "a2a"), "--num-attention-heads 6"),
    ((32, 4, 8, 2, "a2a"), "--num-query-groups 2"),
    ((32, 2, 8, 8, "a2a+p2p"), "a2a+p2p"),
    ((32, 2, 8, 8, "ring"), "--cp-comm-type 'ring'"),
    ((32, 2, 8, 3, "p2p"), "--num-query-groups 3"),
])
def test_bad_layouts_get_one_line_naming_the_flag(args, flag):
    with pytest.raises(ValueError) as err:
        check_context_parallel(*args)
    assert flag in str(err.value) and "\n" not in str(err.value)


def test_heads_need_not_divide_cp_for_p2p_and_all_gather():
    check_context_parallel(32, 4, 6, 6, "p2p")
    check_context_parallel(32, 4, 6, 2, "all_gather")


def test_attention_dropout_is_refused_in_one_line():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="--attention-dropout") as err:
        context_parallel_attention(q, q, q, None, dropout_p=0.1)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_all_gather_blocks_tile_each_ranks_causal_mask(cp):
    """all_gather's blocks (query rows, global key rows, causal) cover exactly the causal
    mask of the local queries, each allowed score once, with no block beyond the diagonal."""
    seq = 8 * cp
    for rank in range(cp):
        queries = rank_positions(seq, cp, rank)
        covered = torch.zeros(seq // cp, seq, dtype=torch.int64)
        for chunk in query_blocks(seq, cp, rank, causal=True):
            for rows, cols, causal in chunk:
                block = torch.ones(rows.stop - rows.start, cols.stop - cols.start,
                                   dtype=torch.int64)
                covered[rows, cols] += block.tril() if causal else block
        want = (torch.arange(seq).unsqueeze(0) <= queries.unsqueeze(1)).long()
        assert torch.equal(covered, want), f"cp{cp} rank {rank}"
    (only,) = query_blocks(seq, cp, 0, causal=False)
    assert only == [(slice(0, seq // cp), slice(0, seq), False)]
