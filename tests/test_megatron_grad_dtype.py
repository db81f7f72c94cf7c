"""Megatron's mixed-precision flags keep Megatron's meaning and defaults (issue 31).

Gradients are accumulated and reduced over data parallelism in one dtype, Megatron-LM's
(megatron/training/arguments.py, DistributedDataParallelConfig.grad_reduce_in_fp32): --fp16 in
fp16 unless --accumulate-allreduce-grads-in-fp32, --bf16 in fp32 unless --grad-reduce-in-bf16.
Checked on the flags' typed fields, the built ZeRO grad buffers, the dtype on the wire of a
forked dp2 run (ZeRO 1: grads are reduce-scattered), and `gigatron plan`'s grad bytes; a
--deepspeed-config's data_types.grad_accum_dtype "fp32" keeps --fp16's grads in fp32.

The dp2 runs train TinyLM (tests/zero_models.py) 3 SGD steps (momentum 0.9, no clipping, no
weight decay: the update is linear in the gradient, so a wrong average or unscale shows,
where Adam would hide a scale) and are compared with an independent reference on one
process: plain torch mixed precision (fp16/bf16 model on the full batch, the loss times a
static scale of 1024 under fp16, fp32 master weights stepped by torch.optim.SGD). Measured
(torch 2.13, CPU), largest parameter difference / largest |parameter| of its tensor: 9.6e-4
under fp16 and 5.4e-3 under bf16, one unit in the last place of the 16-bit parameters
(the half batches' backward sums in another order, fp16's halves are added on the wire);
doubled gradients (a missing average over dp) are off by 0.12, a missing unscale by far more.
Tolerance: 3 x the parameters' machine epsilon (2.9e-3 fp16, 2.3e-2 bf16).

--attention-softmax-in-fp32: the unfused attention's torch softmax runs in fp32 with it (and
with --apply-query-key-layer-scaling, as in Megatron), in the bf16 scores' dtype without it.
"""
import json

import pytest
import torch

from multirank import run_on_ranks
from zero_models import TinyLM, batches

from gigatron import ops
from gigatron.models.transformer import CoreAttention
from gigatron.parallel import comm
from gigatron.parallel.zero import build_zero
from gigatron.training.config.arguments import build_run_config, parse_flags
from gigatron.training.plan.planner import context_of, partition_of
from gigatron.training.plan.memory import plan_memory

TINY = ["--num-layers", "2", "--hidden-size", "24", "--num-attention-heads", "2",
        "--seq-length", "8", "--micro-batch-size", "2", "--train-iters", "3", "--mock-data",
        "--vocab-size", "64", "--lr", "0.1", "--optimizer", "sgd", "--clip-grad", "0",
        "--weight-decay", "0", "--loss-scale", "1024"]
STEPS, BATCH, ULPS = 3, 8, 3
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def run_of(*flags: str, world: int = 1):
    return build_run_config(parse_flags(TINY + list(flags)), world)


@pytest.mark.parametrize("flags, reduced_in", [
    ((), "fp32"),
    (("--fp16",), "fp16"),
    (("--fp16", "--accumulate-allreduce-grads-in-fp32"), "fp32"),
    (("--fp16", "--grad-reduce-in-bf16"), "fp16"),  # Megatron reads it only under --bf16
    (("--bf16",), "fp32"),
    (("--bf16", "--grad-reduce-in-bf16"), "bf16"),
    (("--bf16", "--grad-reduce-in-bf16", "--accumulate-allreduce-grads-in-fp32"), "bf16"),
    (("--grad-reduce-in-bf16",), "fp32"),
])
def test_grad_buffers_and_reduction_take_megatrons_dtype(flags, reduced_in):
    run = run_of(*flags)
    assert run.settings.precision.accumulate_allreduce_grads_in_fp32 == \
        ("--accumulate-allreduce-grads-in-fp32" in flags)
    assert run.zero.grad_reduce_dtype == reduced_in
    zero = build_zero(TinyLM(dtype=run.model.params_dtype), run.zero)
    for group in zero.flat_groups:
        assert group.reduce_dtype == DTYPES[reduced_in]
        assert group.grad_buffer is not None and group.grad_buffer.dtype == DTYPES[reduced_in]


def _dp2(rank, world, zero_config, dtype):
    """3 steps on this rank's half of each batch; (parameters, dtypes reduce-scattered)."""
    wire = set()
    reduce_scatter = comm.reduce_scatter

    def recording(out, tensor, *args, **kwargs):
        wire.add(tensor.dtype)
        return reduce_scatter(out, tensor, *args, **kwargs)

    comm.reduce_scatter = recording
    model = TinyLM(dtype=dtype)
    zero = build_zero(model, zero_config)
    per = BATCH // world
    for tokens, labels in batches(STEPS, BATCH):
        zero.zero_grad()
        zero.backward(model(tokens[rank * per:(rank + 1) * per],
                            labels[rank * per:(rank + 1) * per]).mean())
        assert zero.step().success
    return {n: p.detach().float() for n, p in model.named_parameters()}, wire


def _reference(dtype, scale):
    """Plain torch mixed precision on one process: the full batch, fp32 master weights."""
    model = TinyLM(dtype=dtype)
    master = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    sgd = torch.optim.SGD(master, lr=0.1, momentum=0.9)
    for tokens, labels in batches(STEPS, BATCH):
        model.zero_grad()
        (model(tokens, labels).mean() * scale).backward()
        for m, p in zip(master, model.parameters()):
            m.grad = p.grad.float() / scale
        sgd.step()
        with torch.no_grad():
            for m, p in zip(master, model.parameters()):
                p.copy_(m)
    return {n: p.detach().float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("precision, scale, wire", [("--fp16", 1024.0, torch.float16),
                                                   ("--bf16", 1.0, torch.float32)])
def test_dp2_with_megatrons_default_grad_dtype_trains_the_one_process_reference(
        precision, scale, wire):
    run = run_of(precision, "--use-distributed-optimizer")
    results = run_on_ranks(_dp2, 2, run.zero, run.model.params_dtype)
    reference = _reference(run.model.params_dtype, scale)
    rtol = ULPS * torch.finfo(run.model.params_dtype).eps
    for params, seen in results:
        assert seen == {wire}
        for name, want in reference.items():
            err = (params[name] - want).abs().max().item()
            assert err <= rtol * want.abs().max().item(), f"{precision} {name}: {err:.3g}"


def test_plan_counts_grads_in_the_reduce_dtype():
    def grad_bytes(*flags):
        run = run_of("--fp16", *flags)
        stages = plan_memory(run.model, partition_of(run), 1, 1, run.zero, 2, 1, False, 1,
                             None, context_of(run), run.parallel.pipeline_schedule)
        return stages[0].state.grads, stages[0].parameters

    fp16, params = grad_bytes()
    fp32, _ = grad_bytes("--accumulate-allreduce-grads-in-fp32")
    assert (fp16, fp32) == (2 * params, 4 * params)


@pytest.mark.parametrize("flags, fp32_softmax", [
    ((), False), (("--attention-softmax-in-fp32",), True),
    (("--apply-query-key-layer-scaling",), True)])
def test_attention_softmax_in_fp32_sets_the_unfused_softmax_dtype(flags, fp32_softmax,
                                                                   monkeypatch):
    run = run_of("--bf16", "--attention-backend", "unfused", *flags)
    assert run.model.attention_softmax_in_fp32 is fp32_softmax
    monkeypatch.setenv("GIGATRON_OPS_BACKEND", "torch")  # the fused kernels are fp32 always
    attention = CoreAttention(run.model, None).eval()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, 1, 2, 12, generator=g).to(torch.bfloat16) for _ in range(3))
    heads = [t.permute(1, 2, 0, 3)[0] for t in (q, k, v)]  # [heads, s, d] of the one sample
    scores = torch.matmul(heads[0], heads[1].transpose(1, 2))
    mask = torch.ones(8, 8, dtype=torch.bool).triu(1)
    in_bf16 = torch.softmax((scores * attention.scale).masked_fill(mask, float("-inf")), -1)
    in_fp32 = ops.scaled_upper_triang_masked_softmax(scores, attention.scale)  # fp32 inside
    assert in_bf16.dtype == in_fp32.dtype == torch.bfloat16 and \
        not torch.equal(in_bf16, in_fp32)
    want, other = (in_fp32, in_bf16) if fp32_softmax else (in_bf16, in_fp32)
    out = attention(q, k, v).view(8, 2, 12).transpose(0, 1)  # [heads, s, d]
    assert torch.equal(out, torch.bmm(want, heads[2]))
    assert not torch.equal(out, torch.bmm(other, heads[2]))


@pytest.mark.parametrize("data_types, reduced_in", [(None, "fp16"), ("fp32", "fp32")])
def test_deepspeed_configs_grad_accum_dtype_fp32_keeps_fp16_grads_in_fp32(
        tmp_path, data_types, reduced_in):
    config = {"fp16": {"enabled": True, "loss_scale": 1024}}
    if data_types:
        config["data_types"] = {"grad_accum_dtype": data_types}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    flags = [f for f in TINY if f not in ("--loss-scale", "1024")]
    run = build_run_config(parse_flags(flags + ["--deepspeed-config", str(path)]), 1)
    assert run.zero.grad_reduce_dtype == reduced_in


def test_grad_reduce_in_bf16_against_a_deepspeed_config_accumulating_in_fp32(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True},
                                "data_types": {"grad_accum_dtype": "fp32"}}))
    with pytest.raises(ValueError, match='--grad-reduce-in-bf16 conflicts with '
                                         'data_types.grad_accum_dtype: "fp32"'):
        parse_flags(TINY + ["--bf16", "--grad-reduce-in-bf16", "--deepspeed-config", str(path)])
