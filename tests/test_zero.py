"""ZeRO stages 0-3 train the same model as one process with torch.optim.AdamW.

Forked gloo ranks, fp32, TinyLM (tests/zero_models.py), global batch 12, 3 AdamW steps
(the bf16-reduce run 5).
Tolerance: every parameter within 1e-5 x its largest absolute value (relative) of the
single-process reference on the full batch; gradient accumulation of 3 micro-batches too.
Memory and communication checks use the same runs (dp=4): see the assertions' comments.
"""
import contextlib

import pytest
import torch

from multirank import run_on_ranks
from zero_models import TinyLM, batches, reference_adamw

from gigatron.parallel import comm
from gigatron.parallel.zero import (ZeroConfig, ZeroGroups, build_zero, measure_memory,
                                    zero_comm_bytes_formula, zero_memory_formula)
from gigatron.parallel.zero.layout import plan_buckets, shard_overlaps
from gigatron.training.config.deepspeed.engine import engine_config

STEPS, BATCH, LR, WD, RTOL = 5, 12, 1e-2, 0.1, 1e-5  # STEPS: train()'s default, other files'
# this file's runs: 3 steps (the 2nd and 3rd use Adam's moments and bias correction); with 5
# the dp4 world's 8 runs (every collective ~5 ms of CPU on 4 ranks) took 6.3 CPU-s, now 3.3
OWN_STEPS = 3
BUCKET = 300  # elements: several buckets per group


def train(rank, world, stage, accum, steps=STEPS, model=None, zero=None, first_step=0, **cfg):
    """Train TinyLM on this rank's slice of each global batch; returns (model, zero, log)."""
    model = model or TinyLM()
    zero = zero or build_zero(model, ZeroConfig(zero_stage=stage, lr=LR, weight_decay=WD,
                                                reduce_bucket_size=BUCKET, **cfg))
    per, log = BATCH // world, []
    for tokens, labels in batches(first_step + steps, BATCH)[first_step:]:
        comm.stats.reset()
        tokens, labels = tokens[rank * per:(rank + 1) * per], labels[rank * per:(rank + 1) * per]
        zero.zero_grad()
        mb = per // accum
        for i in range(accum):
            with zero.no_sync() if i < accum - 1 else contextlib.nullcontext():
                loss = model(tokens[i * mb:(i + 1) * mb], labels[i * mb:(i + 1) * mb]).mean()
                zero.backward(loss / accum)
        log.append((zero.step(), comm.stats.snapshot()))
    return model, zero, log


def full_params(model, zero):
    with zero.gathered_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _stages_dp4(rank, world):
    out = {}
    for stage in range(4):
        for accum in (1, 3):
            model, zero, log = train(rank, world, stage, accum, OWN_STEPS)
            out[(stage, accum)] = {
                "params": full_params(model, zero), "memory": measure_memory(zero),
                "comm": log[-1][1], "padded": sum(g.full_numel for g in zero.flat_groups),
                "numel": sum(p.numel() for p in model.parameters())}
    return out


def _stages_dp2(rank, world):
    out = {}
    for stage in range(4):
        for accum in (1, 3):
            model, zero, _ = train(rank, world, stage, accum, OWN_STEPS)
            out[(stage, accum)] = full_params(model, zero)
    model, zero, _ = train(rank, world, 1, 1, OWN_STEPS, offload_optimizer="cpu")
    out["offload"] = (full_params(model, zero), zero.flat_groups[0].master.device.type)
    model, zero, log = train(rank, world, 2, 1, grad_reduce_in_bf16=True)  # STEPS: see below
    out["bf16_reduce"] = (full_params(model, zero), log[-1][1])
    out["resume"] = {stage: _resume(rank, world, stage) for stage in (1, 3)}
    out["overlap"] = _launches_during_backward(rank, world)
    return out


def _launches_during_backward(rank, world):
    """Reductions issued while backward still runs: calls seen in the embedding's grad hook
    (the last grad backward produces) with no_sync, then without."""
    model = TinyLM()
    zero = build_zero(model, ZeroConfig(zero_stage=0, reduce_bucket_size=BUCKET))
    seen = []
    model.embedding.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(comm.stats.calls.get("all_reduce", 0)))
    (tokens, labels), = batches(1, 2)
    comm.stats.reset()
    with zero.no_sync():
        zero.backward(model(tokens, labels).mean())
    zero.backward(model(tokens, labels).mean())
    return seen, len(zero.flat_groups[0].buckets) + len(zero.flat_groups[1].buckets)


def _resume(rank, world, stage):
    """Save the sharded state after all steps but the last, restore it into a fresh model, run
    the last (its update uses the restored moments and step count)."""
    model, zero, _ = train(rank, world, stage, 1, steps=OWN_STEPS - 1)
    state = zero.state_dict()
    fresh = TinyLM(seed=99)  # different weights: the checkpoint must overwrite them
    fresh_zero = build_zero(fresh, ZeroConfig(zero_stage=stage, lr=LR, weight_decay=WD,
                                              reduce_bucket_size=BUCKET))
    fresh_zero.load_state_dict(state)
    train(rank, world, stage, 1, steps=1, model=fresh, zero=fresh_zero,
          first_step=OWN_STEPS - 1)
    return full_params(fresh, fresh_zero)


def assert_matches(params, ref, rtol=RTOL, what=""):
    for name, want in ref.items():
        err = (params[name].float() - want.float()).abs().max().item()
        scale = want.float().abs().max().item()
        assert err <= rtol * scale, f"{what} {name}: max error {err:.3g} > {rtol} x {scale:.3g}"


@pytest.fixture(scope="module")
def reference():
    return reference_adamw(OWN_STEPS, BATCH, LR, WD)


def test_stages_0_to_3_dp4_match_single_device_adamw_memory_and_comm(reference):
    results = run_on_ranks(_stages_dp4, 4)
    for key, res in results[0].items():
        for r in range(4):
            assert_matches(results[r][key]["params"], reference, what=f"dp4 stage/accum {key}")
    res = {stage: results[1][(stage, 1)] for stage in range(4)}
    numel = res[0]["numel"]
    mem = {s: res[s]["memory"] for s in range(4)}
    pad = 12 * (res[1]["padded"] - numel)  # master + Adam moments of padding elements
    # stage 1: optimizer state is a quarter of stage 0's (up to padding); fp32 stage 0 keeps
    # no master copy (the optimizer steps the parameter buffer), stage 1 at most a quarter
    # (single-bucket groups alias their shard of the parameter buffer too)
    assert abs(mem[1].optimizer_state - mem[0].optimizer_state / 4) <= pad
    assert mem[0].master_params == 0 and mem[3].master_params == 0
    assert 0 < mem[1].master_params <= 4 * numel / 4 + pad
    assert mem[1].grads == mem[0].grads and mem[1].params == mem[0].params + \
        4 * (res[1]["padded"] - numel)
    # stage 2: grads a quarter too; stage 3: parameters too (measured after the step, outside
    # the gather window)
    assert abs(mem[2].grads - mem[0].grads / 4) <= 4 * (res[2]["padded"] - numel)
    assert abs(mem[3].params - mem[0].params / 4) <= 4 * (res[3]["padded"] - numel)
    assert abs(mem[3].grads - mem[0].grads / 4) <= 4 * (res[3]["padded"] - numel)
    for stage in range(4):  # the ZeRO-paper formula (fp32 params, grads, master; Adam) within 2%
        # fp32 stages 0 and 3: the master shard is the parameter storage itself (1-2: checked
        # above, single-bucket groups alias it too)
        want = zero_memory_formula(numel, 4, stage, param_bytes=4, grad_bytes=4,
                                   master_bytes=0 if stage in (0, 3) else 4)
        got = mem[stage]
        fields = ("params", "grads", "optimizer_state") + (("master_params",)
                                                           if stage in (0, 3) else ())
        for field in fields:
            w, g = getattr(want, field), getattr(got, field)
            assert abs(g - w) <= 0.02 * w or g == w == 0, \
                f"stage {stage} {field}: measured {g}, formula {w}"
    norm_bytes = 2 * 3 / 4 * 8  # the grad-norm/overflow all-reduce of two fp32 numbers
    for stage in range(4):
        sent = sum(res[stage]["comm"].values()) - norm_bytes
        padded = zero_comm_bytes_formula(res[stage]["padded"], 4, stage, grad_bytes=4)
        assert sent == pytest.approx(padded, abs=1), (stage, res[stage]["comm"])
        exact = zero_comm_bytes_formula(numel, 4, stage, grad_bytes=4)
        assert abs(sent - exact) <= 0.01 * exact  # padding costs < 1%
    assert set(res[3]["comm"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert set(res[0]["comm"]) == {"all_reduce"}


def test_stages_0_to_3_dp2_match_single_device_adamw_offload_bf16_reduce_resume(reference):
    results = run_on_ranks(_stages_dp2, 2)
    bf16_reference = reference_adamw(STEPS, BATCH, LR, WD)
    for r in range(2):
        for stage in range(4):
            for accum in (1, 3):
                assert_matches(results[r][(stage, accum)], reference,
                               what=f"dp2 stage {stage} accum {accum}")
        params, device = results[r]["offload"]
        assert device == "cpu"
        assert_matches(params, reference, what="offload")
        params, sent = results[r]["bf16_reduce"]
        # bf16 on the wire keeps ~3 significant digits of each grad; where ranks' grads nearly
        # cancel the sum's relative error is large and Adam (whose updates are ~lr whatever
        # the grad size) turns it into up to a fraction of lr per step: bound 0.25 lr/step
        # over STEPS steps (the first steps err most: 3 steps erred 0.3 lr/step)
        for name, want in bf16_reference.items():
            assert (params[name] - want).abs().max() <= 0.25 * LR * STEPS, name
        numel = sum(p.numel() for p in reference.values())
        assert sent["reduce_scatter"] == pytest.approx(numel / 2 * 2, rel=0.01)  # 2 bytes/elt
        for stage in (1, 3):
            assert_matches(results[r]["resume"][stage], reference, what=f"resume {stage}")
        (during_no_sync, during_sync), buckets = results[r]["overlap"]
        # no reduction while accumulating; with sync on, every bucket (the embedding's own
        # included: its hook runs just before ours) was launched from hooks inside backward
        assert during_no_sync == 0 and during_sync == buckets > 1


def test_bucket_plan_packs_in_order_and_pads_for_even_shards():
    numels = [5, 7, 3, 10, 1]
    for ways in (1, 2, 3, 4):
        for size in (1, 6, 12, 100):
            buckets = plan_buckets(numels, size, ways)
            assert [i for b in buckets for i in b.param_indices] == list(range(5))
            offset = shard = 0
            for b in buckets:
                assert b.padded_numel % ways == 0 and 0 <= b.padded_numel - b.numel < ways
                assert b.numel == sum(numels[i] for i in b.param_indices)
                assert b.numel - numels[b.param_indices[-1]] < size  # closes once full
                assert (b.group_offset, b.shard_offset) == (offset, shard)
                offset, shard = offset + b.padded_numel, shard + b.shard_numel
                covered = sorted((i, s, n) for r in range(ways)
                                 for i, s, _, n in shard_overlaps(b, numels, r))
                assert sum(n for _, _, n in covered) == b.numel  # shards tile the bucket


def test_bucket_plan_starts_a_bucket_at_each_unit():
    buckets = plan_buckets([4, 4, 4, 4], 100, 2, unit_ids=[0, 0, 1, 2])
    assert [b.param_indices for b in buckets] == [[0, 1], [2], [3]]


@pytest.mark.parametrize("field, value, words", [
    ("zero_stage", 4, "zero_stage"), ("optimizer", "lamb", "optimizer"),
    ("offload_optimizer", "nvme", "offload_optimizer"), ("grad_reduce_dtype", "fp8", "fp8"),
    ("clip_grad", -1.0, "clip_grad"), ("hysteresis", 0, "hysteresis")])
def test_config_rejects_bad_values_naming_the_field(field, value, words):
    with pytest.raises(ValueError, match=words):
        ZeroConfig(**{field: value})


def test_config_accepts_megatron_and_deepspeed_names():
    assert ZeroConfig(use_distributed_optimizer=True).zero_stage == 1
    assert ZeroConfig(grad_reduce_in_bf16=True).reduce_dtype == torch.bfloat16
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
          "fp16": {"enabled": True, "hysteresis": 3}, "gradient_clipping": 1.0,
          "train_micro_batch_size_per_gpu": 1}
    cfg = engine_config(ds, 1).zero  # the DeepSpeed keys live in the training config table
    assert (cfg.zero_stage, cfg.offload_optimizer, cfg.hysteresis, cfg.clip_grad) == \
        (2, "cpu", 3, 1.0)
    with pytest.raises(ValueError, match="zero_optimization.bogus"):
        engine_config({"zero_optimization": {"bogus": 1}}, 1)
    with pytest.raises(ValueError, match="offload_optimizer"):
        ZeroConfig(offload_optimizer="cpu", zero_stage=0)


def test_stage3_with_pipeline_parallelism_raises_why():
    with pytest.raises(ValueError, match="zero_stage 3 needs pp_size x model chunks 1"):
        build_zero(TinyLM(), ZeroConfig(zero_stage=3), ZeroGroups(pp_size=2))


def test_accumulating_without_no_sync_is_an_error_not_a_double_reduction():
    model = TinyLM()
    zero = build_zero(model, ZeroConfig(zero_stage=0))
    (tokens, labels), = batches(1, 2)
    zero.backward(model(tokens, labels).mean())
    with pytest.raises(RuntimeError, match="no_sync"):
        zero.backward(model(tokens, labels).mean())


@pytest.mark.cuda
def test_cuda_offloaded_stage1_matches_torch_adamw_on_gpu():
    """One GPU, dp group of one: device placement, CPU masters, the CPU step streamed in
    100-element buckets through pinned buffers on copy streams (parallel/zero/offload.py)."""
    ref = TinyLM().cuda()
    opt = torch.optim.AdamW(__import__("zero_models").torch_param_groups(ref, WD), lr=LR)
    model = TinyLM().cuda()
    zero = build_zero(model, ZeroConfig(zero_stage=1, lr=LR, weight_decay=WD,
                                        offload_optimizer="cpu", reduce_bucket_size=BUCKET,
                                        offload_bucket_size=100))
    assert all(g.master.device.type == "cpu" for g in zero.flat_groups)
    assert all(b.is_pinned() for b in zero.offload.grad_buffers + zero.offload.param_buffers)
    for tokens, labels in batches(STEPS, BATCH):
        tokens, labels = tokens.cuda(), labels.cuda()
        opt.zero_grad()
        ref(tokens, labels).mean().backward()
        opt.step()
        zero.zero_grad()
        zero.backward(model(tokens, labels).mean())
        zero.step()
    assert_matches(dict(model.named_parameters()), dict(ref.named_parameters()), what="cuda")


@pytest.mark.parametrize("stage", [2, 3])
def test_stage2_3_accumulation_keeps_one_reduction_per_bucket_in_flight(stage):
    """Stages 2-3 reduce every micro-batch; an in-flight reduction holds its full bucket
    (NCCL keeps an async op's tensors until waited on), so at most one per bucket may be
    pending or memory grows with the number of micro-batches."""
    model = TinyLM()
    zero = build_zero(model, ZeroConfig(zero_stage=stage, reduce_bucket_size=BUCKET))
    buckets = sum(len(g.buckets) for g in zero.flat_groups)
    (tokens, labels), = batches(1, 8)
    for i in range(4):
        zero.backward(model(tokens[2 * i:2 * i + 2], labels[2 * i:2 * i + 2]).mean())
        assert len(zero.grad_sync._inflight) <= buckets


@pytest.mark.parametrize("stage, bucket", [(0, BUCKET), (3, BUCKET), (1, 10 ** 9)])
def test_fp32_master_is_the_parameter_storage_so_parameter_memory_is_1x(stage, bucket):
    """fp32 needs no second copy of the weights (torch DDP keeps one): the optimizer steps
    the parameter storage; stages 1-2 alias it when the group is one bucket."""
    model = TinyLM()
    numel = sum(p.numel() for p in model.parameters())
    zero = build_zero(model, ZeroConfig(zero_stage=stage, lr=LR, reduce_bucket_size=bucket))
    mem = measure_memory(zero)
    padded = sum(g.full_numel for g in zero.flat_groups)
    assert mem.master_params == 0 and mem.params == 4 * padded <= 4 * (numel + 64)
    assert all(g.master_aliases_params for g in zero.flat_groups)
    before = full_params(model, zero)
    tokens, labels = batches(1, BATCH)[0]
    zero.zero_grad()
    zero.backward(model(tokens, labels).mean())
    zero.step()
    after = full_params(model, zero)
    assert all(not torch.equal(before[n], after[n]) for n in before)


def test_zero_and_its_timed_grad_sync_implement_the_executor_protocol():
    from gigatron.parallel.pipeline.interfaces import GradSync
    from gigatron.training.observe.timers import TimedGradSync, Timers

    zero = build_zero(TinyLM(), ZeroConfig(zero_stage=1, lr=LR))
    syncs = [zero, TimedGradSync(zero, Timers())]
    assert all(isinstance(s, GradSync) for s in syncs)
    assert not isinstance(object(), GradSync)
