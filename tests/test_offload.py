"""--optimizer-cpu-offload streams the step bucket by bucket (parallel/zero/offload.py) and
trains what ZeRO without offload trains.

TinyLM (tests/zero_models.py), 4 AdamW steps, ZeRO 1, 2 and 3 at dp1 and dp2 (forked gloo
ranks), offload buckets of 100 elements (dozens per step), clipping on (the norm exceeds
it). Losses are equal exactly; parameters equal exactly in bf16 and fp16, and in fp32 within
1e-6 of each tensor's largest value (torch's fused CPU Adam rounds an element by one ulp
differently when it falls in another vector lane: slices start at other offsets).
Host memory is accounted exactly (nbytes of the masters, the optimizer state and the
buffers) and bounded by 12.5 bytes per parameter of the rank's shard plus the buffers,
whose size does not grow with the model.
"""
import io

import pytest
import torch

from multirank import run_on_ranks
from zero_models import TinyLM, batches

from gigatron.parallel.zero import OptimizerSpec, ZeroConfig, build_zero

STEPS, BATCH, CLIP, BUCKET = 4, 12, 0.05, 100
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the other elementwise rules the stream slices (state built lazily, in the constructor,
# python-int step counts, an extra per-element max)
ELEMENTWISE = [OptimizerSpec("sgd", lr=0.1, momentum=0.9, weight_decay=0.01),
               OptimizerSpec("adagrad", lr=0.05, initial_accumulator_value=0.1),
               OptimizerSpec("adam", lr=1e-2, extra={"bias_correction": False}),
               OptimizerSpec("adamw", lr=1e-2, extra={"amsgrad": True})]


def _train(rank, world, offload, dtype, steps=STEPS, first=0, model=None, zero=None,
           optimizer=None, **cfg):
    """(losses, skipped flags, full params, zero) of `steps` steps on this rank's slice."""
    model = model or TinyLM(dtype=dtype)
    cfg = {"zero_stage": 1, "lr": 1e-2, "weight_decay": 0.1, "reduce_bucket_size": 300,
           "clip_grad": CLIP, "offload_bucket_size": BUCKET, **cfg}
    zero = zero or build_zero(model, ZeroConfig(offload_optimizer="cpu" if offload else "none",
                                                **cfg), optimizer=optimizer)
    per, losses, skipped = BATCH // world, [], []
    for tokens, labels in batches(first + steps, BATCH)[first:]:
        zero.zero_grad()
        loss = model(tokens[rank * per:(rank + 1) * per],
                     labels[rank * per:(rank + 1) * per]).float().mean()
        zero.backward(loss)
        result = zero.step()
        losses.append(loss.item())
        skipped.append(result.skipped)
        if result.grad_norm is not None:
            assert result.grad_norm.item() > CLIP  # clipping acts on every step
    with zero.gathered_parameters():
        params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, skipped, params, zero


def _pair(rank, world, dtype, **cfg):
    """(without offload, with offload): losses, skipped flags, params."""
    return [_train(rank, world, offload, dtype, **cfg)[:3] for offload in (False, True)]


def _everything(rank, world):
    """Every run of this file at one dp size, in one set of forked ranks."""
    out = {(stage, name): _pair(rank, world, dtype, zero_stage=stage)
           for stage in (1, 2, 3) for name, dtype in PRECISIONS.items()}
    # fp16: the first steps overflow at 2**24 and are skipped (hysteresis 1 halves the scale)
    out[(2, "fp16")] = _pair(rank, world, torch.float16, zero_stage=2, initial_scale_power=24,
                             hysteresis=1, steps=6)
    out["host"] = _host_bytes(rank, world)
    out["resume"] = _resume(rank, world)
    out["overlap_param_gather"] = _overlapped_gather(rank, world)
    out["optimizers"] = {}
    for spec in ELEMENTWISE:
        runs = [_train(rank, world, offload, torch.bfloat16, zero_stage=2, steps=3,
                       optimizer=spec) for offload in (False, True)]
        out["optimizers"][spec.type] = ([r[:3] for r in runs], runs[1][3].offload.streamed)
    lamb = OptimizerSpec("lamb", lr=1e-2, weight_decay=0.1)
    plain = _train(rank, world, False, torch.float32, steps=2, optimizer=lamb)
    offloaded = _train(rank, world, True, torch.float32, steps=2, optimizer=lamb)
    out["lamb"] = ([plain[:3], offloaded[:3]], offloaded[3].offload.streamed,
                   offloaded[3].offload.host_bytes()["grads"])
    return out


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def runs(request):
    return run_on_ranks(_everything, request.param)


def _assert_same(pair, exact, what):
    (losses, skipped, params), (off_losses, off_skipped, off_params) = pair
    assert off_losses == losses and off_skipped == skipped, what
    for name, want in params.items():
        err = (off_params[name] - want).abs().max().item()
        bound = 0.0 if exact else 1e-6 * want.abs().max().item()
        assert err <= bound, f"{what} {name}: {err:.3g} > {bound:.3g}"


def test_offloaded_zero_1_2_3_match_zero_without_offload_fp32_bf16_fp16_clipped(runs):
    for rank_results in runs:
        for key, pair in rank_results.items():
            if isinstance(key, tuple):
                _assert_same(pair, exact=key[1] != "fp32", what=f"stage {key[0]} {key[1]}")
        skipped = rank_results[(2, "fp16")][0][1]
        assert skipped[0] and not skipped[-1], skipped  # overflow skipped, then trained


def _host_bytes(rank, world):
    out = {}
    for layers in (2, 6):
        _, _, _, zero = _train(rank, world, True, torch.bfloat16, steps=1,
                               model=TinyLM(layers=layers, dtype=torch.bfloat16))
        shard = sum(p.numel() for g in zero.flat_groups for p in g.params) / world
        out[layers] = (zero.offload.host_bytes(), shard)
    return out


def test_host_holds_12_bytes_per_parameter_of_its_shard_plus_a_fixed_buffer(runs):
    for rank_results in runs:
        host_of = rank_results["host"]
        buffers = {layers: host["buffers"] for layers, (host, _) in host_of.items()}
        assert buffers[2] == buffers[6] == 2 * BUCKET * (4 + 2)  # fp32 down, bf16 up
        for layers, (host, shard) in host_of.items():
            assert host["grads"] == 0  # no full-size host copy of the grads
            held = host["master"] + host["optimizer_state"]
            assert 12 * shard <= held <= 12.5 * shard, (layers, host, shard)


def _overlapped_gather(rank, world):
    """ZeRO 2 with --overlap-param-gather, without and with offload: (runs, copies of the
    masters into the parameters after the step's stream already wrote them)."""
    runs, copies = [], []
    for offload in (False, True):
        model = TinyLM(dtype=torch.bfloat16)
        zero = build_zero(model, ZeroConfig(
            zero_stage=2, lr=1e-2, weight_decay=0.1, reduce_bucket_size=300, clip_grad=CLIP,
            overlap_param_gather=True, offload_optimizer="cpu" if offload else "none",
            offload_bucket_size=BUCKET))
        count = [0]
        for g in zero.flat_groups:
            def counted(original=g.copy_master_to_shard):
                count[0] += 1
                original()
            g.copy_master_to_shard = counted
        runs.append(_train(rank, world, offload, torch.bfloat16, model=model, zero=zero)[:3])
        copies.append(count[0])
    return runs, copies


def test_overlapped_param_gather_after_an_offloaded_step_copies_no_master_again(runs):
    """The stream wrote the updated bf16 slices already: the gathers start from them (a
    second copy from the fp32 masters would cost 2 B/param of host memory at once on a GPU,
    converting before the copy, and a pageable transfer of the whole shard)."""
    for rank_results in runs:
        pair, (plain_copies, offloaded_copies) = rank_results["overlap_param_gather"]
        _assert_same(pair, exact=True, what="overlap_param_gather")
        assert plain_copies > 0 and offloaded_copies == 0


def _resume(rank, world):
    """3 steps, save, a fresh model (other weights) loads the state, 2 more steps: equals
    5 steps in one go, bit for bit."""
    whole = _train(rank, world, True, torch.bfloat16, steps=5, zero_stage=2)
    _, _, _, zero = _train(rank, world, True, torch.bfloat16, steps=3, zero_stage=2)
    saved = io.BytesIO()
    torch.save(zero.state_dict(), saved)
    saved.seek(0)
    fresh = TinyLM(dtype=torch.bfloat16, seed=99)
    fresh_zero = build_zero(fresh, ZeroConfig(
        zero_stage=2, lr=1e-2, weight_decay=0.1, reduce_bucket_size=300, clip_grad=CLIP,
        offload_optimizer="cpu", offload_bucket_size=BUCKET))
    fresh_zero.load_state_dict(torch.load(saved, weights_only=False))
    resumed = _train(rank, world, True, torch.bfloat16, steps=2, first=3, model=fresh,
                     zero=fresh_zero)
    return whole[0][3:], whole[2], resumed[0], resumed[2]


def test_offloaded_checkpoint_resumes_exactly(runs):
    for rank_results in runs:
        losses, params, resumed_losses, resumed_params = rank_results["resume"]
        assert resumed_losses == losses
        for name, want in params.items():
            assert torch.equal(resumed_params[name], want), name


def test_sgd_adagrad_uncorrected_adam_and_amsgrad_stream_the_same_steps(runs):
    for rank_results in runs:
        for name, (pair, streamed) in rank_results["optimizers"].items():
            assert streamed, name
            _assert_same(pair, exact=True, what=name)


def test_an_optimizer_that_is_not_elementwise_steps_whole_shards_on_the_host(runs):
    """Lamb's trust ratio needs each parameter whole: the offload path hands it the grad
    shard in one host buffer (4 bytes per parameter more) and still trains the same."""
    for rank_results in runs:
        pair, streamed, host_grads = rank_results["lamb"]
        assert not streamed and host_grads > 0
        _assert_same(pair, exact=False, what="lamb")
