"""--tp-comm-overlap (issue 42, tensor-parallel half): the sequence-parallel all-gathers and
reduce-scatters of the transformer layers' linears run as rings of async point-to-point
chunks under the GEMMs (parallel/tensor/async_tp.py), with the same numbers.

Model level (GPTModel on forked gloo ranks, fp32, dropout 0): the loss and every gradient
equal the plain collectives' with rtol 1e-6 / atol 1e-7; the rings sum the tp partials in
another order. Measured (CPU, torch 2.13): tp2 bit for bit, tp4 within 1.5e-8. The chunking
is checked by counting: every overlapped linear trades one all-gather or reduce-scatter for
tp - 1 sends, and each GEMM chunk but the last of a ring runs between a ring step's issue and
its wait; multi-latent attention and the ag-only half too; the weight gradients defer to
the zero-bubble W queue.

The real program (pretrain.main, --mock-data, 3 iterations, SGD): tp2 + sp with the flag
trains the losses and parameters of tp2 + sp without it (measured: bit for bit), pp2 x tp2
with zb-h1 and full recomputation too (tolerance 1e-5 as tests/test_zero_bubble_training.py; measured: losses
equal, parameters within 1.6e-7); the merged --timeline shows GEMM chunks inside tp-group
send/recv spans. Removing the overlap from the builders, breaking a ring's chunk order or
computing the weight gradient in B under deferral (tried) fails these tests.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from multirank import run_on_ranks

from gigatron.models.gpt import GPTModel
from gigatron.models.zoo import load_config
from gigatron.parallel import comm
from gigatron.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from gigatron.parallel.tensor import async_tp
from gigatron.parallel.tensor.async_tp import TPCommOverlap, enable_tp_comm_overlap

RTOL, ATOL = 1e-6, 1e-7


def _linears(model):
    return [m for m in model.decoder.modules()
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _train_step(model, ids, labels):
    comm.stats.reset()
    loss = model(ids, labels=labels).mean()
    loss.backward()
    return loss.detach(), dict(comm.stats.calls), {n: p.grad.clone()
                                                    for n, p in model.named_parameters()}


def _compare(rank, world_size, style, overlap, **overrides):
    group = dist.new_group(list(range(world_size)))
    cfg = load_config(style, sequence_parallel=True, hidden_dropout=0.0, attention_dropout=0.0,
                      **overrides)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length), generator=g)
    plain = GPTModel(cfg, tp_group=group)
    ref_loss, ref_calls, ref_grads = _train_step(plain, ids, labels)
    model = GPTModel(cfg, tp_group=group)
    overlapped = enable_tp_comm_overlap(_linears(model), overlap)
    events = []
    _log_ring(events)
    loss, calls, grads = _train_step(model, ids, labels)
    torch.testing.assert_close(loss, ref_loss, rtol=RTOL, atol=ATOL)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{style} tp{world_size} {name}: {m}")
    return calls, ref_calls, events, cfg.num_layers, overlapped


def _log_ring(events):
    """Record ring issues, waits and GEMM chunks in the order they happen (this rank)."""
    start, wait, gemm = async_tp._Ring.start, async_tp._Ring.wait, async_tp._gemm

    def logged_start(self, tensor):
        events.append("issue")
        return start(self, tensor)

    def logged_wait(self):
        events.append("wait")
        return wait(self)

    def logged_gemm(fn, *args):
        events.append("gemm")
        return gemm(fn, *args)

    async_tp._Ring.start, async_tp._Ring.wait, async_tp._gemm = \
        logged_start, logged_wait, logged_gemm


@pytest.mark.parametrize("world_size,style", [(2, "debug-gpt2"), (4, "debug-llama")])
def test_overlapped_sequence_parallel_linears_give_the_same_loss_and_grads(world_size, style):
    per_rank = run_on_ranks(_compare, world_size, style, TPCommOverlap())
    for calls, ref_calls, events, layers, overlapped in per_rank:
        linears = 4 * layers  # qkv and fc1 (column), proj and fc2 (row) per layer
        assert overlapped == linears
        # forward: column all-gathers, row reduce-scatters; backward: the mirror
        assert ref_calls["all_gather"] - calls.get("all_gather", 0) == 2 * layers * 2
        assert ref_calls["reduce_scatter"] - calls.get("reduce_scatter", 0) == 2 * layers * 2
        assert calls["send"] == 2 * linears * (world_size - 1)  # forward and backward rings
        assert "send" not in ref_calls
        # every ring step but the last: issue, then the GEMM of the chunk held, then wait
        steps = "".join({"issue": "i", "gemm": "g", "wait": "w"}[e] for e in events)
        assert steps.count("igw") == 2 * linears * (world_size - 1)
        assert steps.count("g") == 2 * linears * world_size


# multi-latent attention: its sequence-parallel linears (q_proj or the q/kv down-projections,
# which gather their latents, and proj) run overlapped; the up-projections have no sp
MLA = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8,
           qk_pos_emb_head_dim=4, v_head_dim=6)


def test_multi_latent_attention_overlapped_gives_the_same_loss_and_grads():
    per_rank = run_on_ranks(_compare, 2, "debug-llama", TPCommOverlap(), **MLA)
    # per layer: q and kv down-projections, proj, fc1, fc2
    assert [r[4] for r in per_rank] == [5 * per_rank[0][3]] * 2


def test_only_the_all_gathers_overlap_when_reduce_scatters_are_off():
    per_rank = run_on_ranks(_compare, 2, "debug-gpt2", TPCommOverlap(ag=True, rs=False))
    calls, ref_calls, _, layers, _ = per_rank[0]
    assert ref_calls["all_gather"] - calls.get("all_gather", 0) == 4 * layers
    assert calls["reduce_scatter"] == ref_calls["reduce_scatter"]
    assert calls["send"] == 2 * 2 * layers


# -- the real program: pretrain.main on forked ranks -----------------------------------------
TRAIN_TOL = 1e-5  # losses (absolute) and every full parameter (relative L2), as the zero-bubble
# tests; measured (CPU, torch 2.13): tp2 0 (bit-for-bit), pp2 x tp2 zb-h1 within 1e-7
GPT = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
       "--micro-batch-size 2 --global-batch-size 8 --lr 0.05 --optimizer sgd --mock-data "
       "--vocab-size 128 --eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 "
       "--init-method-std 0.1 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 "
       "--train-iters 3 --lr-warmup-iters 0 --tensor-model-parallel-size 2 "
       "--sequence-parallel").split()


def _pretrain(rank, world, argv, metrics):
    """pretrain.main(argv): this rank's full parameters after training (tp gathered) and how
    many of its linears ran overlapped."""
    import contextlib
    import io

    from gigatron.parallel.tensor import gather_full_parameter
    from gigatron.training.run import loop, pretrain

    real_train, captured = loop.train, {}

    def train(session, progress):
        result = real_train(session, progress)
        captured["params"] = {
            name: gather_full_parameter(p, session.groups.tp).detach().clone()
            for chunk in session.chunks for name, p in chunk.named_parameters()}
        captured["overlapped"] = sum(getattr(m, "tp_comm_overlap", None) is not None
                                     for chunk in session.chunks for m in chunk.modules())
        return result

    loop.train = train
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert pretrain.main(argv + ["--metrics-file", metrics]) == 0
    return captured["params"], captured["overlapped"], out.getvalue()


def _losses(path):
    with open(path) as f:
        return [r["lm loss"] for r in map(json.loads, f) if r["type"] == "train"]


def _compare_runs(got, ref):
    (params, losses), (ref_params, ref_losses) = got, ref
    assert len(losses) == 3 and losses[0] != losses[-1]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TRAIN_TOL, (losses, ref_losses)
    assert set(ref_params) <= set(params)
    for name, ref in ref_params.items():
        error = ((params[name] - ref).norm() / ref.norm()).item()
        assert error <= TRAIN_TOL, (name, error)


def _train(tmp_path, name, ranks, flags):
    metrics = str(tmp_path / f"{name}.jsonl")
    per_rank = run_on_ranks(_pretrain, ranks, GPT + flags, metrics, timeout=300)
    params = {}
    for p, _, _ in per_rank:
        params.update(p)
    return per_rank, (params, _losses(metrics))


def test_tp2_sp_and_pp2_zero_bubble_train_the_same_model_with_overlap_and_trace_it(tmp_path):
    _, reference = _train(tmp_path, "plain", 2, [])
    trace = str(tmp_path / "t.json")
    per_rank, overlapped = _train(tmp_path, "overlap", 2, ["--tp-comm-overlap",
                                                           "--timeline", trace])
    assert [n for _, n, _ in per_rank] == [4 * 2] * 2  # 2 layers x qkv, proj, fc1, fc2
    assert "--tp-comm-overlap: the transformer layers' sequence-parallel all-gathers and " \
           "reduce-scatters run as rings" in per_rank[0][2]
    _compare_runs(overlapped, reference)
    _check_overlap_in_trace(trace)
    # pp2 with zb-h1: the overlapped linears' weight gradients deferred to W, their forward
    # recomputed inside B (the rings run again there)
    per_rank, pipelined = _train(tmp_path, "zb", 4, [
        "--tp-comm-overlap", "--pipeline-model-parallel-size", "2",
        "--pipeline-schedule", "zb-h1", "--recompute-granularity", "full",
        "--recompute-method", "uniform", "--recompute-num-layers", "1"])
    assert [n for _, n, _ in per_rank] == [4] * 4
    _compare_runs(pipelined, reference)


def _check_overlap_in_trace(path):
    """On each rank, some GEMM chunk runs inside a tp-group send/recv in flight."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
    for pid in (0, 1):
        gemms = [e for e in events if e["pid"] == pid and e["name"] == async_tp.GEMM_SPAN]
        rings = [e for e in events if e["pid"] == pid and e["tid"] >= 1000
                 and e["name"].startswith("send/recv") and "tp group" in e["args"]["group"]]
        assert gemms and rings, (pid, len(gemms), len(rings))
        inside = [g for g in gemms if any(
            r["ts"] <= g["ts"] and g["ts"] + g["dur"] <= r["ts"] + r["dur"] for r in rings)]
        # every ring step but the last runs its GEMM under the exchange: half of them at tp2
        assert len(inside) * 2 >= len(gemms), (pid, len(inside), len(gemms))


def _problems(argv):
    from gigatron.training.config.arguments import build_run_config, parse_flags
    from gigatron.training.config.validation import ConfigError

    with pytest.raises(ConfigError) as error:
        build_run_config(parse_flags(argv, "pretrain_gpt.py"), 2, None)
    return str(error.value)


def test_tp_comm_overlap_without_sequence_parallel_or_with_fp8_is_refused_in_one_line():
    no_sp = [f for f in GPT if f != "--sequence-parallel"] + ["--tp-comm-overlap"]
    assert _problems(no_sp) == (
        "--tp-comm-overlap needs --sequence-parallel (as in Megatron: the overlapped "
        "collectives are its all-gathers and reduce-scatters): add --sequence-parallel")
    message = _problems(GPT + ["--tp-comm-overlap", "--fp8-format", "hybrid"])
    assert "--tp-comm-overlap with --fp8-format is not supported here" in message


def test_megatron_family_flags_are_accepted_and_the_halves_honoured():
    from gigatron.training.config.arguments import build_run_config, parse_flags
    from gigatron.training.config.megatron.tp_comm import tp_comm_overlap

    run = build_run_config(parse_flags(GPT + [
        "--tp-comm-overlap", "--disable-tp-comm-overlap-rs", "--tp-comm-overlap-rs-dgrad",
        "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-bulk-dgrad",
        "--disable-tp-comm-split-ag", "--no-tp-comm-split-rs", "--tp-comm-overlap-cfg",
        "ub.yaml", "--tp-comm-bootstrap-backend", "mpi"], "pretrain_gpt.py"), 2, None)
    assert tp_comm_overlap(run.settings.tp_comm) == TPCommOverlap(ag=True, rs=False)


def test_a_linear_with_fp8_or_without_sequence_parallel_refuses_overlap():
    layer = ColumnParallelLinear(8, 8)  # no tp group: no sequence parallelism
    with pytest.raises(ValueError, match="needs sequence_parallel"):
        async_tp.check_overlap(layer)
    assert enable_tp_comm_overlap([layer]) == 0 and layer.tp_comm_overlap is None
    layer.sequence_parallel, layer.fp8 = True, object()
    with pytest.raises(ValueError, match="tp_comm_overlap and fp8 are not composed"):
        enable_tp_comm_overlap([layer])


def _split_backward(rank, world_size):
    from gigatron.parallel.tensor.wgrad import WeightGradQueue, deferring

    group = dist.new_group(list(range(world_size)))
    torch.manual_seed(rank)
    col = ColumnParallelLinear(8, 16, tp_group=group, sequence_parallel=True)
    row = RowParallelLinear(16, 8, tp_group=group, sequence_parallel=True)
    params = [col.weight, col.bias, row.weight, row.bias]
    with torch.no_grad():
        for p in params:
            p.normal_()
    enable_tp_comm_overlap([col, row])
    x = torch.randn(4, 2, 8, requires_grad=True)  # this rank's 4 of 8 positions

    def step(queue):
        for t in params + [x]:
            t.grad = None
        with deferring(queue):
            row(col(x)).square().sum().backward()
        after_b = [p.grad is None for p in params]
        if queue is not None:
            queue.run()
        return after_b, [t.grad.clone() for t in params + [x]]

    queue = WeightGradQueue()
    _, plain = step(None)
    after_b, deferred = step(queue)
    assert after_b == [True, False, True, False]  # weights wait for W, biases do not
    for a, b in zip(plain, deferred):
        assert torch.equal(a, b)
    return len(queue)


def test_overlapped_linears_defer_their_weight_gradients_to_the_zero_bubble_w_step():
    assert run_on_ranks(_split_backward, 2) == [0, 0]
