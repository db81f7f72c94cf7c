"""Horovod behaviours that users' scripts rely on, one check per function, on any number of
ranks >= 2: run on forked ranks by tests/test_horovod_api.py, and as a whole program
(`python tests/horovod_checks.py`) under mpirun and gigatron launch, where hvd.init() makes
the process group itself and shutdown() then init() must work again. Each check asserts and
must leave every rank able to run the next one (no hang, no abort)."""
import faulthandler
import os
import sys

import torch

import gigatron.horovod as hvd


def _raises_on_every_rank(fn, kind=RuntimeError):
    try:
        fn()
    except kind as err:
        return str(err)
    raise AssertionError(f"{fn} did not raise {kind.__name__}")


def check_mismatches_raise_on_every_rank(rank, size):
    hvd.init()
    int_or_float = torch.ones(3, dtype=torch.int32 if rank % 2 else torch.float32)
    assert "data types" in _raises_on_every_rank(lambda: hvd.allreduce(int_or_float))
    assert "shapes" in _raises_on_every_rank(lambda: hvd.allreduce(torch.ones(4 + rank)))
    assert "shapes" in _raises_on_every_rank(lambda: hvd.allreduce(torch.ones(2, 3) if rank
                                                                   else torch.ones(3, 2)))
    assert "shapes" in _raises_on_every_rank(lambda: hvd.broadcast(torch.ones(2 + rank), 0))
    assert "root ranks" in _raises_on_every_rank(lambda: hvd.broadcast(torch.ones(2), rank))
    assert "operations" in _raises_on_every_rank(
        lambda: hvd.allreduce(torch.ones(1), name="x") if rank else hvd.allgather(
            torch.ones(1), name="x"))
    assert "data types" in _raises_on_every_rank(lambda: hvd.alltoall(int_or_float[:2]))
    # and the ranks still agree afterwards
    assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == size


def check_duplicate_in_flight_names_raise_and_names_match_out_of_order(rank, size):
    hvd.init()
    t = torch.ones(3)
    handles = []
    if rank == 0:  # Horovod's own test: rank 0 submits first, the others after a barrier
        handles.append(hvd.allreduce_async(t, name="dup", op=hvd.Sum))
        _raises_on_every_rank(lambda: hvd.allreduce_async(t, name="dup"), ValueError)
    hvd.barrier()
    if rank > 0:
        handles.append(hvd.allreduce_async(t, name="dup", op=hvd.Sum))
        _raises_on_every_rank(lambda: hvd.allreduce_async(t, name="dup"), ValueError)
    hvd.barrier()
    a = hvd.allreduce_async(torch.tensor([1.0 * rank]), name="a", op=hvd.Sum)
    b = hvd.allreduce_async(torch.tensor([2.0]), name="b", op=hvd.Sum)
    order = (a, b) if rank % 2 else (b, a)  # waited for in different orders
    results = {h: hvd.synchronize(h) for h in order}
    assert results[a].item() == sum(range(size)) and results[b].item() == 2 * size
    assert hvd.synchronize(handles[0]).tolist() == [size] * 3


def check_process_sets_reduce_within_the_set(rank, size):
    hvd.init()
    evens = hvd.add_process_set([r for r in range(size) if r % 2 == 0])
    odds = hvd.add_process_set(hvd.ProcessSet([r for r in range(size) if r % 2]))
    mine = evens if rank % 2 == 0 else odds
    members = mine.ranks
    assert mine.included() and mine.rank() == members.index(rank) and mine.size() == len(members)
    summed = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum, process_set=mine)
    assert summed.item() == sum(members)
    gathered = hvd.allgather(torch.tensor([rank]), process_set=mine)
    assert gathered.tolist() == members
    root = members[-1]
    assert hvd.broadcast(torch.tensor([rank]), root, process_set=mine).item() == root
    assert hvd.broadcast_object(rank, root, process_set=mine) == root
    hvd.barrier(process_set=mine)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), process_set=mine)
    model(torch.full((1, 3), float(rank))).sum().backward()
    opt.synchronize()
    expected = sum(members) / len(members)
    assert torch.allclose(model.weight.grad, torch.full((1, 3), expected))
    assert hvd.remove_process_set(odds) and hvd.remove_process_set(evens)
    assert not hvd.remove_process_set(hvd.global_process_set)


def check_reducescatter_alltoall_grouped_allgather_int16(rank, size):
    hvd.init()
    rows = 2 * size + 1  # uneven: the first rank keeps one more row
    x = torch.arange(rows * 2, dtype=torch.float32).view(rows, 2).requires_grad_()
    out = hvd.reducescatter(x, op=hvd.Sum)
    start = sum(rows // size + (r < rows % size) for r in range(rank))
    mine = rows // size + (rank < rows % size)
    assert torch.equal(out, x.detach()[start:start + mine] * size)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, float(size)))  # Horovod's Sum gradient
    avg = hvd.reducescatter(torch.ones(size, 3, dtype=torch.int16) * (rank + 1))
    assert avg.dtype == torch.int16 and avg.tolist() == [[(size + 1) // 2] * 3]
    splits = torch.tensor([rank + 1] * size, dtype=torch.int32)
    data = torch.full((size * (rank + 1), 2), float(rank), requires_grad=True)
    got, received = hvd.alltoall(data, splits)
    assert received.tolist() == [r + 1 for r in range(size)]
    assert got[:, 0].tolist() == [float(r) for r in range(size) for _ in range(r + 1)]
    got.sum().backward()
    assert torch.equal(data.grad, torch.ones_like(data))
    assert hvd.alltoall(torch.arange(size) + 10 * rank).tolist() == [10 * r + rank
                                                                     for r in range(size)]
    _raises_on_every_rank(lambda: hvd.alltoall(torch.ones(size), torch.ones(size)), ValueError)
    shorts = hvd.grouped_allgather([torch.full((1,), rank, dtype=torch.int16)] * 2)
    assert [s.tolist() for s in shorts] == [list(range(size))] * 2
    assert hvd.allreduce(torch.tensor([rank], dtype=torch.int16), op=hvd.Sum).item() == \
        sum(range(size))
    assert hvd.broadcast(torch.tensor([rank], dtype=torch.int16), 1).item() == 1


def check_join_adds_zeros_and_returns_the_last_rank(rank, size):
    hvd.init()
    t = torch.full((3,), float(rank + 1))
    if rank == 0:
        last = hvd.join()
    else:
        averaged = hvd.allreduce(t, name="joined")  # rank 0 adds zeros, the size divides
        assert torch.allclose(averaged, torch.full((3,), sum(range(2, size + 1)) / size))
        assert "joined" in _raises_on_every_rank(lambda: hvd.allgather(t))
        last = hvd.join()
    assert last != 0 and hvd.allgather_object(last) == [last] * size


def check_join_covers_distributed_optimizer_steps(rank, size):
    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters())
    grads = []
    for step in range(1 if rank == 0 else 2):  # rank 0 runs out of data first
        opt.zero_grad()
        model(torch.full((1, 2), float(rank + 1))).sum().backward()
        opt.step()
        grads.append(model.weight.grad.clone())
    hvd.join()
    everyone = sum(range(1, size + 1))
    assert torch.equal(grads[0], torch.full((1, 2), everyone / size))
    if rank > 0:  # the joined rank added zeros, the size still divides
        assert torch.equal(grads[1], torch.full((1, 2), (everyone - 1) / size))


def check_sparse_allreduce_and_sparse_gradients(rank, size):
    hvd.init()
    g = torch.Generator().manual_seed(rank)
    dense = torch.rand(6, 4, generator=g) * (torch.rand(6, 1, generator=g) > 0.5)
    reduced = hvd.sparse_allreduce_async(dense.to_sparse(), name="s", op=hvd.Average)()
    assert torch.allclose(reduced.to_dense(), hvd.allreduce(dense))
    grads = []
    for as_dense in (False, True):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(10, 3, sparse=True)
        opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
                                       sparse_as_dense=as_dense)
        emb(torch.tensor([rank, 5, rank + 2])).sum().backward()
        opt.synchronize()
        grads.append(emb.weight.grad.to_dense())
        with opt.skip_synchronize():
            opt.step()
    assert torch.allclose(grads[0], grads[1])


def check_broadcast_optimizer_state_sets_grads_and_names(rank, size):
    hvd.init()
    model = torch.nn.Linear(2, 2)
    frozen = torch.nn.Parameter(torch.ones(1), requires_grad=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [frozen], lr=0.1,
                                                   momentum=0.9))
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert frozen.grad is None
    assert sorted(opt._parameter_names.values()) == ["allreduce.noname.0.0",
                                                     "allreduce.noname.0.1",
                                                     "allreduce.noname.0.2"]


CHECKS = [v for k, v in sorted(globals().items()) if k.startswith("check_")]


def main() -> None:
    """Every check on the launched ranks, then shutdown -> init -> a collective, 3 times."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    for check in CHECKS:
        faulthandler.dump_traceback_later(60, exit=True)  # a hang fails, loudly
        check(rank, size)
        hvd.barrier()
    for _ in range(3):  # Horovod's gloo-mode tests shut down and init around every test
        hvd.shutdown()
        assert not hvd.is_initialized()
        hvd.init()
        assert (hvd.rank(), hvd.size()) == (rank, size)
        assert hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item() == size
    faulthandler.cancel_dump_traceback_later()
    print(f"rank {rank}: {len(CHECKS)} horovod checks passed, re-init ok", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
