"""The forked-rank harness itself: results, rank errors and hangs fail the test in bounds."""
import os
import time

import pytest
import torch
import torch.distributed as dist

from multirank import RankError, RanksTimedOut, run_on_ranks


def _sum_of_ranks(rank, world_size, scale):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item() * scale, os.getpid()


def test_returns_each_ranks_result_in_rank_order():
    results = run_on_ranks(_sum_of_ranks, 8, 2.0)
    assert [r[0] for r in results] == [56.0] * 8
    assert len({pid for _, pid in results}) == 8  # really 8 processes


def _fail_on_rank_3(rank, world_size):
    if rank == 3:
        raise ValueError("rank three is broken")
    dist.barrier()  # the others wait for rank 3 and must be cleaned up


def test_exception_on_rank_3_surfaces_as_rank_3s_error():
    with pytest.raises(RankError) as err:
        run_on_ranks(_fail_on_rank_3, 4, timeout=60)
    message = str(err.value)
    assert message.startswith("rank 3 failed")
    assert "ValueError: rank three is broken" in message
    assert "_fail_on_rank_3" in message  # the traceback came along


def _hang_on_rank_1(rank, world_size):
    if rank == 1:
        time.sleep(600)
    return os.getpid()


def test_hanging_rank_fails_within_the_bound_and_leaves_no_process():
    start = time.monotonic()
    with pytest.raises(RanksTimedOut, match=r"ranks \[1\] of 4 did not finish within 8 s"):
        run_on_ranks(_hang_on_rank_1, 4, timeout=8)
    assert time.monotonic() - start < 20
    import multiprocessing
    assert multiprocessing.active_children() == []


def _die_hard(rank, world_size):
    if rank == 0:
        os._exit(7)
    dist.barrier()


def test_rank_that_dies_without_reporting_is_named():
    with pytest.raises(RankError, match="rank 0 died with exit code 7"):
        run_on_ranks(_die_hard, 2, timeout=60)
