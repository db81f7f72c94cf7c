"""gigatron.horovod: Horovod's PyTorch API -- a Horovod script with only its import changed
trains on forked ranks exactly like one process over the same global batch; fp16
compression and backward_passes_per_step match their definitions; the collectives'
values; what is not implemented says so."""
import argparse
import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

import gigatron.horovod as hvd
from gigatron.engine.horovod.basics import node_layout
from gigatron.engine.horovod.optimizer import fusion_threshold, plan_buckets
from multirank import free_port, run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "horovod_style", "pytorch_mnist.py")


def _example():
    spec = importlib.util.spec_from_file_location("hvd_pytorch_mnist", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example(rank, world_size, argv):
    example = _example()
    args = example.parser.parse_args(argv)
    args.cuda = False
    return example.main(args)


def _train(world_size, batch_per_rank, lr, extra=()):
    argv = ["--batch-size", str(batch_per_rank), "--lr", str(lr), "--epochs", "2",
            "--samples", "128", "--log-interval", "1000", *extra]
    return run_on_ranks(_run_example, world_size, argv, timeout=240)


# ---- the canonical example ---------------------------------------------------------------

def test_the_example_differs_from_horovods_only_by_its_import():
    text = open(EXAMPLE).read()
    code = text.split('"""', 2)[2]  # after the module docstring
    assert [line for line in code.splitlines() if "gigatron" in line] == [
        "import gigatron.horovod as hvd  # the one line that differs: import horovod.torch as hvd"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_train_like_one_process_over_the_same_global_batch(world_size):
    """lr scaled by hvd.size() as the example does; the reference runs the global batch."""
    reference = _train(1, 8 * world_size, 0.01 * world_size)[0]
    results = _train(world_size, 8, 0.01)
    for r in range(1, world_size):  # every rank holds the same model
        for k, v in results[0]["state"].items():
            assert torch.equal(v, results[r]["state"][k]), k
    for k, v in reference["state"].items():
        torch.testing.assert_close(results[0]["state"][k], v, rtol=1e-5, atol=1e-5)
    mean_losses = torch.tensor([r["losses"] for r in results]).mean(dim=0)
    torch.testing.assert_close(mean_losses, torch.tensor(reference["losses"]), rtol=1e-5,
                               atol=1e-5)


def _learned(losses):
    return sum(losses[-4:]) < sum(losses[:4])


def test_mixed_precision_gradscaler_loop_trains_on_two_ranks():
    """bf16 autocast on CPU (fp16 on GPUs) with torch.amp.GradScaler, Horovod's AMP loop."""
    results = _train(2, 8, 0.05, ["--use-mixed-precision"])
    reference = _train(1, 16, 0.1, ["--use-mixed-precision"])[0]
    for k, v in results[0]["state"].items():
        assert torch.equal(v, results[1]["state"][k]), k
        torch.testing.assert_close(v, reference["state"][k], rtol=3e-2, atol=3e-2)
    assert _learned(results[0]["losses"]) and _learned(reference["losses"])


def test_fp16_allreduce_flag_trains_and_keeps_ranks_identical():
    results = _train(2, 8, 0.05, ["--fp16-allreduce"])
    for k, v in results[0]["state"].items():
        assert torch.equal(v, results[1]["state"][k]), k
    assert _learned(results[0]["losses"])


def test_adasum_flag_is_a_clear_error():
    with pytest.raises(Exception, match="op=hvd.Adasum is not implemented in gigatron.horovod"):
        _train(2, 8, 0.01, ["--use-adasum"])


# ---- DistributedOptimizer semantics ------------------------------------------------------

def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(rank, step=0):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(5, 6, generator=g), torch.randn(5, 4, generator=g)


def _local_grads(model, rank, step=0):
    x, y = _batch(rank, step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    return torch.autograd.grad(loss, list(model.parameters()))  # no .grad, no hooks


def _backward(model, rank, step=0):
    x, y = _batch(rank, step)
    torch.nn.functional.mse_loss(model(x), y).backward()


def _fp16_grads(rank, world_size):
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16)
    local = _local_grads(model, rank)
    everyone = [hvd.allgather(g.unsqueeze(0)) for g in local]  # [world, *shape] per param
    _backward(model, rank)
    opt.synchronize()
    return [p.grad for p in model.parameters()], local, everyone


def test_fp16_compression_is_grads_rounded_to_fp16_then_averaged():
    for reduced, local, everyone in run_on_ranks(_fp16_grads, 2):
        for got, mine, all_ranks in zip(reduced, local, everyone):
            halves = all_ranks.half()
            expected = (halves[0] + halves[1]) / 2  # summed and averaged in fp16
            assert got.dtype == torch.float32
            assert torch.equal(got, expected.float())
        fp32 = [a.mean(0) for a in everyone]
        assert any(not torch.equal(g, f) for g, f in zip(reduced, fp32))  # it was rounded


def _accumulated(rank, world_size):
    hvd.init()
    model, reference = _model(), _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   backward_passes_per_step=2)
    _backward(model, rank, 0)
    launched_after_first = sum(b.inflight is not None for b in opt._buckets)
    _backward(model, rank, 1)
    launched_after_second = sum(b.inflight is not None for b in opt._buckets)
    opt.step()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _backward(reference, rank, 0)
    _backward(reference, rank, 1)  # two local backwards, then one all-reduce
    for p in reference.parameters():
        hvd.allreduce_(p.grad, op=hvd.Average)
    ref_opt.step()
    _backward(model, rank, 2)
    _backward(model, rank, 3)
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        _backward(model, rank, 4)
    return (launched_after_first, launched_after_second, len(opt._buckets),
            [p.detach() for p in model.parameters()], [p.detach() for p in reference.parameters()])


def test_backward_passes_per_step_is_local_accumulation_then_one_allreduce():
    for first, second, buckets, params, reference in run_on_ranks(_accumulated, 2):
        assert (first, second) == (0, buckets)
        for p, q in zip(params, reference):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


def _overlap(rank, world_size):
    os.environ["HOROVOD_FUSION_THRESHOLD"] = "256"  # bytes: several buckets for this model
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum)
    _backward(model, rank)
    launched_in_backward = [b.inflight is not None for b in opt._buckets]
    local = _local_grads(model, rank)
    with pytest.raises(AssertionError, match="zero_grad"):
        opt.zero_grad()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    summed = [hvd.allreduce(g, op=hvd.Sum) for g in local]
    with pytest.warns(UserWarning, match="skip_synchronize"):
        opt.step()  # reduces again: Horovod warns the same way
    return launched_in_backward, grads, summed


def test_buckets_are_reduced_during_backward_and_sum_adds():
    for launched, grads, summed in run_on_ranks(_overlap, 2):
        assert len(launched) >= 3 and all(launched)
        for g, s in zip(grads, summed):
            torch.testing.assert_close(g, s, rtol=1e-6, atol=1e-7)


def _predivide(rank, world_size):
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   gradient_predivide_factor=4.0)
    local = _local_grads(model, rank)
    _backward(model, rank)
    opt.synchronize()
    return [p.grad for p in model.parameters()], [hvd.allreduce(g) for g in local]


def test_gradient_predivide_factor_still_averages():
    for grads, averaged in run_on_ranks(_predivide, 2):
        for g, a in zip(grads, averaged):
            torch.testing.assert_close(g, a, rtol=1e-6, atol=1e-7)


def _unused_parameter(rank, world_size):
    hvd.init()
    model = _model()
    extra = torch.nn.Parameter(torch.ones(3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(list(model.parameters()) + [extra], lr=0.1))
    _backward(model, rank)
    opt.step()
    return extra.grad, isinstance(opt, torch.optim.SGD), type(opt).__name__


def test_a_parameter_backward_did_not_reach_gets_a_zero_gradient_like_horovod():
    for grad, is_sgd, name in run_on_ranks(_unused_parameter, 2):
        assert torch.equal(grad, torch.zeros(3)) and is_sgd and name == "SGD"


def test_optimizer_argument_errors_are_horovods():
    hvd.init()
    try:
        model = _model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(ValueError, match="backward_passes_per_step must be > 0"):
            hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
        with pytest.raises(ValueError, match="only supported with op=hvd.Average"):
            hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
        with pytest.raises(ValueError, match="not in it"):
            hvd.DistributedOptimizer(sgd, named_parameters=list(model.named_parameters())[:1])
        with pytest.raises(ValueError, match="unique"):
            hvd.DistributedOptimizer(sgd, named_parameters=[("w", p) for p in model.parameters()])
        with pytest.raises(NotImplementedError, match="Adasum .*use op=hvd.Average"):
            hvd.DistributedOptimizer(sgd, op=hvd.Adasum)
        with pytest.raises(ValueError, match="not registered"):
            hvd.DistributedOptimizer(sgd, process_set=hvd.ProcessSet([0]))
        wrapped = hvd.DistributedOptimizer(sgd)
        assert wrapped.param_groups[0]["lr"] == 0.1 and wrapped.state is sgd.state
    finally:
        hvd.shutdown()


# ---- collectives ------------------------------------------------------------------------

def _collectives(rank, world_size):
    hvd.init()
    r, n = float(rank), world_size
    out = {"avg": hvd.allreduce(torch.tensor([r, 1.0])),
           "sum": hvd.allreduce(torch.tensor([r]), op=hvd.Sum),
           "max": hvd.allreduce(torch.tensor([r]), op=hvd.Max),
           "min": hvd.allreduce(torch.tensor([r]), op=hvd.Min),
           "scaled": hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, prescale_factor=2.0,
                                   postscale_factor=3.0),
           "int_avg": hvd.allreduce(torch.tensor([rank * 3])),
           "fp16": hvd.allreduce(torch.tensor([r + 0.1]), compression=hvd.Compression.fp16)}
    t = torch.tensor([r])
    out["inplace_is_same"] = hvd.allreduce_(t, op=hvd.Sum) is t
    out["inplace"] = t
    src = torch.tensor([r, r])
    h = hvd.allreduce_async(src, op=hvd.Sum)
    hvd.barrier()
    out["polled"] = hvd.poll(h)
    out["async"], out["async_input"] = hvd.synchronize(h), src
    h = hvd.allreduce_async_(torch.full((2,), r))
    out["async_"] = hvd.synchronize(h)
    out["grouped"] = hvd.grouped_allreduce([torch.tensor([r]), torch.tensor([2 * r])], op=hvd.Sum)
    out["gather"] = hvd.allgather(torch.full((rank + 1, 2), r))
    out["gather_async"] = hvd.synchronize(hvd.allgather_async(torch.tensor([rank])))
    out["bcast"] = hvd.broadcast(torch.tensor([r]), root_rank=1)
    b = torch.tensor([r, r, r, r])
    hvd.synchronize(hvd.broadcast_async_(b[::2], root_rank=1))  # a non-contiguous view
    out["bcast_async_"] = b
    out["bcast_async"] = hvd.synchronize(hvd.broadcast_async(torch.tensor([r]), 1))
    out["object"] = hvd.broadcast_object({"from": rank, "f": lambda: 3}, root_rank=1)["from"]
    out["objects"] = hvd.allgather_object(("rank", rank))
    x = torch.tensor([r + 1.0], requires_grad=True)
    (hvd.allreduce(x, op=hvd.Sum) * (r + 1)).sum().backward()
    out["allreduce_grad"] = x.grad
    y = torch.full((rank + 1,), 1.0, requires_grad=True)
    (hvd.allgather(y) * torch.arange(1.0, 1 + sum(range(1, n + 1)))).sum().backward()
    out["allgather_grad"] = y.grad
    try:
        hvd.allgather(torch.zeros(1, rank + 1))
    except RuntimeError as err:  # Horovod's type, on every rank
        out["mismatch"] = str(err)
    out["layout"] = (hvd.size(), hvd.rank(), hvd.local_size(), hvd.local_rank(),
                     hvd.cross_size(), hvd.cross_rank(), hvd.is_homogeneous())
    return out


def test_collective_values_on_three_ranks():
    results = run_on_ranks(_collectives, 3)
    for rank, out in enumerate(results):
        assert torch.equal(out["avg"], torch.tensor([1.0, 1.0]))
        assert out["sum"].item() == 3 and out["max"].item() == 2 and out["min"].item() == 0
        assert out["scaled"].item() == 18  # (2 * 1) * 3 ranks * 3
        assert out["int_avg"].dtype == torch.int64 and out["int_avg"].item() == 3
        assert abs(out["fp16"].item() - 1.1) < 5e-3 and out["fp16"].dtype == torch.float32
        assert out["inplace_is_same"] and out["inplace"].item() == 3
        assert torch.equal(out["async"], torch.tensor([3.0, 3.0]))
        assert torch.equal(out["async_input"], torch.tensor([float(rank)] * 2))
        assert out["polled"] in (True, False)
        assert torch.equal(out["async_"], torch.tensor([1.0, 1.0]))
        assert [g.item() for g in out["grouped"]] == [3, 6]
        assert torch.equal(out["gather"], torch.tensor([[0.0] * 2] + [[1.0] * 2] * 2
                                                       + [[2.0] * 2] * 3))
        assert out["gather_async"].tolist() == [0, 1, 2]
        assert out["bcast"].item() == 1 and out["bcast_async"].item() == 1
        assert out["bcast_async_"].tolist() == [1.0, float(rank)] * 2
        assert out["object"] == 1 and out["objects"] == [("rank", r) for r in range(3)]
        # d/dx of sum_r (r+1) * allreduce_sum(x): Horovod's backward all-reduces with Sum
        assert out["allreduce_grad"].item() == 6
        # Horovod's allgather gradient: this rank's rows of the averaged upstream gradient
        start = sum(range(1, rank + 1))
        assert out["allgather_grad"].tolist() == [float(i) for i in range(start + 1,
                                                                         start + rank + 2)]
        assert "Mismatched allgather tensor shapes beyond the first" in out["mismatch"]
        assert out["layout"] == (3, rank, 3, rank, 1, 0, True)


def _broadcast_state(rank, world_size):
    hvd.init()
    model = _model(seed=rank)  # different on every rank
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 1:  # the root has trained a step; the others are fresh
        _backward(model, rank)
        opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=1)
    hvd.broadcast_optimizer_state(opt, root_rank=1)
    state = opt.state_dict()
    return ([p.detach() for p in model.parameters()], state["param_groups"][0]["lr"],
            {i: {k: v for k, v in s.items()} for i, s in state["state"].items()})


def test_broadcast_parameters_and_optimizer_state_from_a_root():
    results = run_on_ranks(_broadcast_state, 2)
    (params1, lr1, state1) = results[1]
    for params, lr, state in results:
        assert lr == lr1 == 0.02
        for p, q in zip(params, params1):
            assert torch.equal(p, q)
        assert state.keys() == state1.keys() and len(state) == 4
        for i in state:
            for k in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[i][k], state1[i][k])


def _named_parameters_broadcast(rank, world_size):
    hvd.init()
    model = _model(seed=rank)
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    return [p.detach() for p in model.parameters()]


def test_broadcast_parameters_takes_named_parameters():
    a, b = run_on_ranks(_named_parameters_broadcast, 2)
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def _timeline_run(rank, world_size, path):
    os.environ["GIGATRON_TIMELINE"] = path  # as `gigatron launch --timeline` sets it
    hvd.init()
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(2):
        opt.zero_grad()
        _backward(model, rank, step)
        opt.step()
    hvd.stop_timeline()


def test_the_timeline_shows_every_ranks_gradient_reduction_and_step(tmp_path):
    import json
    path = str(tmp_path / "hvd.json")
    run_on_ranks(_timeline_run, 2, path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    spans = [(e["pid"], e["name"]) for e in events if e.get("ph") == "X"]
    for name in ("gradient reduction", "optimizer step", "all_reduce"):
        assert len({pid for pid, n in spans if n == name}) == 2, (name, sorted(set(spans)))


# ---- process queries, errors, pure helpers ----------------------------------------------

def test_node_layout_is_horovods_local_and_cross_ranks():
    hosts, local = ["a", "a", "b", "b"], [0, 1, 0, 1]
    assert [node_layout(hosts, local, r) for r in range(4)] == [
        (2, 0, 2, True), (2, 0, 2, True), (2, 1, 2, True), (2, 1, 2, True)]
    # Horovod's docstring: 2 processes on one node and 1 on the other
    assert node_layout(["a", "a", "b"], [0, 1, 0], 1) == (2, 0, 1, False)
    assert node_layout(["a", "a", "b"], [0, 1, 0], 2) == (1, 1, 2, False)


def test_queries_before_init_say_to_call_init():
    hvd.shutdown()
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match=r"use hvd.init\(\)"):
        hvd.rank()


def test_a_world_of_one_without_a_launcher():
    hvd.init()
    try:
        assert (hvd.size(), hvd.rank(), hvd.local_size(), hvd.cross_size()) == (1, 0, 1, 1)
        assert torch.equal(hvd.allreduce(torch.tensor([2.0])), torch.tensor([2.0]))
        assert hvd.broadcast_object("x") == "x" and hvd.allgather_object(1) == [1]
    finally:
        hvd.shutdown()


def test_not_implemented_names_fail_clearly_when_used():
    from gigatron.horovod import SyncBatchNorm  # importing works, as scripts do at the top
    with pytest.raises(NotImplementedError, match="hvd.SyncBatchNorm is not implemented"):
        SyncBatchNorm(4)
    with pytest.raises(NotImplementedError, match="hvd.elastic is not implemented"):
        hvd.elastic.run
    with pytest.raises(AttributeError):
        hvd.no_such_function
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="supersedes average"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)


def test_buckets_follow_the_fusion_threshold_and_dtype():
    params = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5, dtype=torch.half),
              torch.zeros(5)]
    assert plan_buckets(params, 80) == [[0, 1], [2], [3], [4]]
    assert plan_buckets(params, 0) == [[0], [1], [2], [3], [4]]
    assert plan_buckets(params, 10 ** 9) == [[0, 1, 2], [3], [4]]
    assert plan_buckets(params, 80, groups=2) == [[0, 1], [2, 3, 4]]
    assert plan_buckets(params, 80, groups=[[params[4], params[0]]]) == [[4, 0], [1], [2], [3]]
    assert fusion_threshold({}) == 128 * 1024 * 1024
    assert fusion_threshold({"HOROVOD_FUSION_THRESHOLD": "0"}) == 0


# ---- real launchers ---------------------------------------------------------------------

def _launch(cmd):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "done: 8 steps" in proc.stdout and "2 ranks" in proc.stdout, proc.stdout[-2000:]


ARGS = ["--epochs", "1", "--samples", "128", "--batch-size", "8", "--fp16-allreduce"]


@pytest.mark.e2e
def test_the_example_runs_under_torchrun():
    _launch([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
             EXAMPLE, *ARGS])


@pytest.mark.e2e
def test_the_example_runs_under_gigatron_launch():
    # a Horovod script parses no --local_rank: DeepSpeed's launcher flag turns it off
    _launch([sys.executable, "-m", "gigatron", "launch", "-np", "2", "--no_local_rank",
             EXAMPLE, *ARGS])


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_the_example_runs_under_mpirun_without_master_addr():
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    _launch(["mpirun", "-np", "2", *root, "--oversubscribe", "-x", f"MASTER_PORT={free_port()}",
             sys.executable, EXAMPLE, *ARGS])
