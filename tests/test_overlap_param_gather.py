"""--overlap-param-gather (ZeRO 1-2, Megatron-Core's): the step launches the parameter
all-gathers and returns; the next forward waits for each bucket just before its first use and
issues the next one (parallel/zero/param_gather.py).

Forked gloo ranks, fp32: the same losses and parameters as without it (bit for bit) at ZeRO 1
and 2 with gradient accumulation; the first bucket's gather is in flight when step() returns
and is waited by the first module's pre-hook, which issues the next; an fp16 overflow step
launches nothing; ZeRO 3's prefetch issues unit i+1's gather before unit i computes.
"""
import contextlib
import os

import pytest
import torch
import torch.nn as nn

from gigatron.parallel.zero import ZeroConfig, build_zero
from gigatron.parallel.zero.flat_group import FlatGroup
from multirank import run_on_ranks


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 2)).to(dtype)


def _batches(rank, world, steps, micro):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        x, y = torch.randn(4 * micro, 6, generator=g), torch.randn(4 * micro, 2, generator=g)
        mine = slice(rank * 4 * micro // world, (rank + 1) * 4 * micro // world)
        out.append(list(zip(x[mine].chunk(micro), y[mine].chunk(micro))))
    return out


def _train(rank, world, stage, overlap, steps=3, micro=2):
    """Losses and final parameters of `steps` steps of `micro` accumulated micro-batches."""
    model = _model()
    zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=40, lr=0.05,
                                        overlap_param_gather=overlap))
    losses = []
    for batch in _batches(rank, world, steps, micro):
        zero.zero_grad()
        for i, (x, y) in enumerate(batch):
            last = i == len(batch) - 1
            with zero.no_sync() if not last else contextlib.nullcontext():
                loss = ((model(x) - y) ** 2).mean() / micro
                zero.backward(loss)
            losses.append(loss.item())
        zero.step()
    with zero.gathered_parameters():
        return losses, [p.detach().clone() for p in model.parameters()]


def _equal_with_and_without(rank, world, stage):
    return _train(rank, world, stage, False), _train(rank, world, stage, True)


@pytest.mark.parametrize("stage", [1, 2])
def test_dp2_losses_and_parameters_equal_those_without_overlap(stage):
    for plain, overlapped in run_on_ranks(_equal_with_and_without, 2, stage, timeout=60):
        assert plain[0] == overlapped[0]
        assert all(torch.equal(a, b) for a, b in zip(plain[1], overlapped[1]))


class _Logged:
    """A gather handle that notes its wait in the shared event list."""

    def __init__(self, work, events, name):
        self.work, self.events, self.name = work, events, name

    def wait(self):
        self.events.append(f"wait {self.name}")
        return self.work.wait()


def _async_events(rank, world):
    """The events of a step and the forward after it: issue/wait of each bucket's gather
    (bucket = index of the Linear holding its parameters) and each Linear's compute."""
    model = _model()
    zero = build_zero(model, ZeroConfig(zero_stage=1, reduce_bucket_size=40, lr=0.05,
                                        overlap_param_gather=True))
    events = []
    real = FlatGroup.start_gather
    linears = [m for m in model if isinstance(m, nn.Linear)]
    owner = {id(p): i for i, m in enumerate(linears) for p in m.parameters()}

    def start_gather(group, bucket):
        name = str(sorted({owner[id(group.params[i])] for i in bucket.param_indices}))
        events.append(f"issue {name}")
        return _Logged(real(group, bucket), events, name)

    FlatGroup.start_gather = start_gather
    for i, m in enumerate(linears):  # registered after ZeRO's pre-hooks: runs after them
        m.register_forward_pre_hook(lambda m, args, i=i: events.append(f"compute {i}"))
    (x, y), = _batches(rank, world, 1, 1)[0]
    zero.zero_grad()
    zero.backward(((model(x) - y) ** 2).mean())
    events.clear()
    zero.step()
    events.append("step returned")
    pending = zero.param_gather.pending
    model(x)
    after_forward = zero.param_gather.pending
    FlatGroup.start_gather = real
    return events, pending, after_forward, [(len(g.buckets), g.weight_decay)
                                            for g in zero.flat_groups]


def test_the_gather_is_in_flight_after_step_and_waited_in_the_first_pre_hook():
    events, pending, after_forward, groups = run_on_ranks(_async_events, 2, timeout=60)[0]
    assert pending and not after_forward, events
    returned = events.index("step returned")
    issued_by_step = [e for e in events[:returned] if e.startswith("issue")]
    assert len(issued_by_step) == 1 and not any(e.startswith("wait") for e in
                                                events[:returned]), events
    first = issued_by_step[0].split(" ", 1)[1]
    compute0 = events.index("compute 0")
    waits = [e for e in events[returned:compute0] if e.startswith("wait")]
    assert waits[0] == f"wait {first}", events  # the first module's pre-hook waits it
    # ... and issues the next bucket, whose gather runs under the first Linear's compute
    under = [e.split(" ", 1)[1] for e in events[returned:compute0] if e.startswith("issue")]
    assert any(f"wait {name}" in events[compute0:] for name in under), events
    for k in range(3):  # every Linear computes after its parameters' gathers were waited
        at = events.index(f"compute {k}")
        holding = {e.split(" ", 1)[1] for e in events if e.startswith("issue") and
                   str(k) in e.split(" ", 1)[1]}
        assert all(f"wait {name}" in events[:at] for name in holding), (k, events)


def _skipped_step(rank, world):
    """fp16: a clean step, then an overflowing one (skipped), then a clean one."""
    model = _model(torch.float16)
    zero = build_zero(model, ZeroConfig(zero_stage=2, reduce_bucket_size=40, lr=0.05,
                                        loss_scale=1.0, overlap_param_gather=True))
    (x, y), = _batches(rank, world, 1, 1)[0]
    x, y = x.half(), y.half()
    seen = []
    for scale in (1.0, float("inf"), 1.0):
        zero.zero_grad()
        zero.backward(((model(x) - y) ** 2).mean() * scale)
        before = [p.detach().clone() for p in model.parameters()]
        result = zero.step()
        pending = zero.param_gather.pending
        with zero.gathered_parameters():
            same = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        seen.append((result.skipped, pending, same))
    return seen


def test_a_skipped_fp16_step_leaves_no_gather_in_flight():
    for seen in run_on_ranks(_skipped_step, 2, timeout=60):
        assert seen == [(False, True, False), (True, False, True), (False, True, False)]


# ---- pretrain_gpt.py runs: evaluation and a checkpoint save/resume between steps -----------
RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
       "--max-position-embeddings 16 --micro-batch-size 2 --lr 1e-2 --mock-data "
       "--vocab-size 128 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 "
       "--eval-iters 1 --eval-interval 2 --no-progress --make-vocab-size-divisible-by 8 "
       "--train-iters 4 --save-interval 2 --ddp-bucket-size 2000 --overlap-grad-reduce").split()
LAYOUTS = {  # world size, flags
    "dp2_zero1": (2, "--zero-stage 1 --global-batch-size 8".split()),
    "dp2_zero2": (2, "--zero-stage 2 --global-batch-size 8".split()),
    "dp2_zero3": (2, "--zero-stage 3 --global-batch-size 8".split()),
    "dp2_pp2_zero1": (4, "--zero-stage 1 --pipeline-model-parallel-size 2 "
                         "--global-batch-size 16".split()),  # 4 micro-batches a step
}


def _pretrain(argv, metrics):
    """pretrain.main(argv): (this rank's parameters at the end, the logged losses)."""
    import json

    from gigatron.training.run import loop, pretrain

    real_train, captured = loop.train, {}

    def train(session, progress):
        result = real_train(session, progress)
        with session.zero.gathered_parameters():
            captured["params"] = {f"{c}.{name}": p.detach().clone()
                                  for c, chunk in enumerate(session.chunks)
                                  for name, p in chunk.named_parameters()}
        return result

    loop.train = train
    try:
        assert pretrain.main(argv + ["--metrics-file", metrics]) == 0
    finally:
        loop.train = real_train
    losses = []
    if os.path.exists(metrics):
        with open(metrics) as f:
            losses = [(r["type"], r["iteration"], r["lm loss"]) for r in map(json.loads, f)
                      if "lm loss" in r]
    return captured["params"], losses


def _three_runs(rank, world, flags, folder):
    """Without the flag, with it (both save at 2 of 4 iterations), and with it resumed from
    iteration 2: one launch (the process group is kept between the runs)."""
    import torch.distributed as dist

    keep, dist.destroy_process_group = dist.destroy_process_group, lambda *a, **k: None
    try:
        runs = {}
        for name, extra in (("plain", []), ("overlap", ["--overlap-param-gather"])):
            runs[name] = _pretrain(RUN + flags + extra + ["--save", f"{folder}/{name}"],
                                   f"{folder}/{name}.jsonl")
            dist.barrier()
        runs["resumed"] = _pretrain(RUN + flags + ["--overlap-param-gather", "--load",
                                                   f"{folder}/overlap", "--ckpt-step", "2"],
                                    f"{folder}/resumed.jsonl")
        return runs
    finally:
        dist.destroy_process_group = keep


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pretrain_with_overlap_equals_without_through_eval_and_resume(tmp_path, layout):
    world, flags = LAYOUTS[layout]
    per_rank = run_on_ranks(_three_runs, world, flags, str(tmp_path), timeout=300)
    for rank, runs in enumerate(per_rank):
        plain, overlap, resumed = (runs[k] for k in ("plain", "overlap", "resumed"))
        assert plain[1] == overlap[1]
        assert [x for x in overlap[1] if x[1] > 2] == resumed[1]
        for params in (overlap[0], resumed[0]):
            assert params.keys() == plain[0].keys()
            bad = [n for n in params if not torch.equal(params[n], plain[0][n])]
            assert not bad, (rank, bad)
    logged = [runs["plain"][1] for runs in per_rank if runs["plain"][1]]
    assert {kind for kind, _, _ in logged[0]} >= {"train"} and len(logged[0]) >= 6, logged
