"""--overlap-param-gather (ZeRO 1-2, Megatron-Core's): the step launches the parameter
all-gathers and returns; the next forward waits for each bucket just before its first use and
issues the next one (parallel/zero/param_gather.py).

Forked gloo ranks, fp32. Optimizer level (one launch): the same losses and parameters as
without it (bit for bit) at ZeRO 1 and 2 with gradient accumulation; the first bucket's gather
is in flight when step() returns and is waited by the first module's pre-hook, which issues
the next; an fp16 overflow step launches nothing; ZeRO 3's prefetch issues unit i+1's gather
before unit i computes. pretrain_gpt.py: at dp2 ZeRO 1/2/3 and dp2 x pp2 the same train and
eval losses and final parameters as without, a resume from its checkpoint continues it
exactly, and its --timeline shows the gathers inside forward spans (the first micro-batch's).
"""
import contextlib
import os

import pytest
import torch
import torch.nn as nn

import gigatron.models.gpt  # noqa: F401 -- imported once here (torch._dynamo: seconds),
from gigatron.training.run import pretrain  # not in every forked rank
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


def _optimizer_checks(rank, world):
    """Every optimizer-level check of this file in one launch of 2 ranks (forks are slow)."""
    return {"equal": {stage: (_train(rank, world, stage, False),
                              _train(rank, world, stage, True)) for stage in (1, 2)},
            "events": _async_events(rank, world), "skipped": _skipped_step(rank, world),
            "zero3": _stage3_states(rank, world)}


@pytest.fixture(scope="module")
def checks():
    return run_on_ranks(_optimizer_checks, 2, timeout=120)


@pytest.mark.parametrize("stage", [1, 2])
def test_dp2_losses_and_parameters_equal_those_without_overlap(checks, stage):
    for rank in checks:
        plain, overlapped = rank["equal"][stage]
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

    FlatGroup.start_gather = start_gather  # (put back below)
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
    return events, pending, after_forward


def test_the_gather_is_in_flight_after_step_and_waited_in_the_first_pre_hook(checks):
    events, pending, after_forward = checks[0]["events"]
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


def test_a_skipped_fp16_step_leaves_no_gather_in_flight(checks):
    for seen in (rank["skipped"] for rank in checks):
        assert seen == [(False, True, False), (True, False, True), (False, True, False)]


# ---- pretrain_gpt.py runs: evaluation and a checkpoint save/resume between steps -----------
RUN = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
       "--max-position-embeddings 16 --micro-batch-size 2 --lr 1e-2 --mock-data "
       "--vocab-size 128 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 "
       "--eval-iters 1 --eval-interval 2 --no-progress --make-vocab-size-divisible-by 8 "
       "--train-iters 3 --save-interval 2 --ddp-bucket-size 2000 --overlap-grad-reduce "
       "--skip-train-test").split()
LAYOUTS = {  # world size, flags
    "dp2_zero1": (2, "--zero-stage 1 --global-batch-size 8".split()),
    "dp2_zero2": (2, "--zero-stage 2 --global-batch-size 8".split()),
    "dp2_zero3": (2, "--zero-stage 3 --global-batch-size 8".split()),
    "dp2_pp2_zero1": (4, "--zero-stage 1 --pipeline-model-parallel-size 2 "
                         "--global-batch-size 12".split()),  # 3 micro-batches a step
}


def _pretrain(argv, metrics):
    """pretrain.main(argv): (this rank's parameters at the end, the logged losses)."""
    import json

    from gigatron.training.run import loop

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


def _three_runs(layouts, folder):
    """Per layout: without the flag, with it (both save at 2 of 3 iterations; traced), and
    with it resumed from iteration 2. All in one launch: the process group is kept."""
    import torch.distributed as dist

    keep, dist.destroy_process_group = dist.destroy_process_group, lambda *a, **k: None
    try:
        out = {}
        for layout in layouts:
            flags, at = LAYOUTS[layout][1], f"{folder}/{layout}"
            traced = ["--overlap-param-gather", "--timeline", f"{at}/t.json"]
            runs = {}
            for name, extra in (("plain", []), ("overlap", traced)):
                runs[name] = _pretrain(RUN + flags + extra + ["--save", f"{at}/{name}"],
                                       f"{at}/{name}.jsonl")
                dist.barrier()
            runs["resumed"] = _pretrain(RUN + flags + ["--overlap-param-gather", "--load",
                                                       f"{at}/overlap", "--ckpt-step", "2"],
                                        f"{at}/resumed.jsonl")
            out[layout] = runs
        return out
    finally:
        dist.destroy_process_group = keep


def _in_one_launch(rank, world, layouts, folder):
    return _three_runs(layouts, folder)


@pytest.fixture(scope="module")
def dp2_runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dp2"))
    layouts = [name for name, (world, _) in LAYOUTS.items() if world == 2]
    return folder, run_on_ranks(_in_one_launch, 2, layouts, folder, timeout=300)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pretrain_with_overlap_equals_without_through_eval_and_resume(dp2_runs, tmp_path,
                                                                      layout):
    world, _ = LAYOUTS[layout]
    folder, per_rank = dp2_runs
    if world != 2:
        folder = str(tmp_path)
        per_rank = run_on_ranks(_in_one_launch, world, [layout], folder, timeout=300)
    for rank, by_layout in enumerate(per_rank):
        runs = by_layout[layout]
        plain, overlap, resumed = (runs[k] for k in ("plain", "overlap", "resumed"))
        assert plain[1] == overlap[1]
        assert [x for x in overlap[1] if x[1] > 2] == resumed[1]
        for params in (overlap[0], resumed[0]):
            assert params.keys() == plain[0].keys()
            bad = [n for n in params if not torch.equal(params[n], plain[0][n])]
            assert not bad, (rank, bad)
    logged = [by_layout[layout]["plain"][1] for by_layout in per_rank
              if by_layout[layout]["plain"][1]]
    assert {"train"} < {kind for kind, _, _ in logged[0]} and len(logged[0]) == 4, logged
    if layout != "dp2_zero3":  # ZeRO 3's gathers are its own prefetch (test below)
        _check_gathers_under_forward(f"{folder}/{layout}/t.json", world)


def _check_gathers_under_forward(path, world):
    """The overlapped run's merged timeline: on every rank, parameter all-gathers over dp
    (the async rows) run inside a forward span: issued by one module's pre-hook, waited by a
    later one's; none is waited in a later micro-batch's forward."""
    import json

    with open(path) as f:
        spans = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    for rank in range(world):
        mine = [e for e in spans if e["pid"] == rank]
        forwards = [e for e in mine if e["name"].startswith("forward mb")]
        gathers = [e for e in mine if e["name"] == "all_gather" and e["tid"] >= 1000
                   and e["args"]["group"].startswith("dp")]
        under = [g for g in gathers if any(f["ts"] <= g["ts"] and g["ts"] + g["dur"] <=
                                           f["ts"] + f["dur"] for f in forwards)]
        assert forwards and under, (rank, gathers)
        # the first micro-batch's forward waits for every bucket: the later ones wait for none
        later = [f for f in forwards if f["args"]["microbatch"] > 0]
        assert not [g for g in gathers for f in later
                    if f["ts"] <= g["ts"] + g["dur"] <= f["ts"] + f["dur"]], rank


# ---- ZeRO 3: the prefetch overlaps -------------------------------------------------------
class _Layers(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


def _stage3_states(rank, world):
    """Per iteration, at each layer's compute: (layer, its unit's state, the next unit's
    state and handles in flight)."""
    model = _Layers()
    zero = build_zero(model, ZeroConfig(zero_stage=3, lr=0.05, overlap_param_gather=True))
    units = zero.gatherer.units
    index = {id(u.module): i for i, u in enumerate(units)}
    seen = []
    for k, layer in enumerate(model.layers):  # after ZeRO's pre-hook: the compute's start
        def note(m, args, k=k):
            mine = index[id(m)]
            nxt = units[mine + 1] if mine + 1 < len(units) and k < 2 else None
            seen[-1].append((k, units[mine].state, None if nxt is None else
                             (nxt.state, len(nxt.handles) > 0)))
        layer.register_forward_pre_hook(note)
    (x, y), = _batches(rank, world, 1, 1)[0]
    x = torch.cat([x, x], dim=1)[:, :8]
    for _ in range(3):
        seen.append([])
        zero.zero_grad()
        zero.backward(((model(x) - y) ** 2).mean())
        zero.step()
    return seen


def test_zero3_issues_the_next_units_gather_before_this_unit_computes(checks):
    for seen in (rank["zero3"] for rank in checks):
        # the first forward records the units' order (no prefetch yet); from the second on,
        # unit i+1's all-gathers are in flight (issued, not waited) while unit i computes
        assert seen[0] == [(0, "ready", ("free", False)), (1, "ready", ("free", False)),
                           (2, "ready", None)], seen
        for iteration in seen[1:]:
            assert iteration == [(0, "ready", ("inflight", True)),
                                 (1, "ready", ("inflight", True)), (2, "ready", None)], seen
