"""The global gradient norm equals the single-device norm, and clipping to it trains the
single-device model (docs/DESIGN.md, 'Global gradient norm is computed once, correctly').

- TinyLM, dp=2, stages 0-3, clip_grad below the norm: each step's norm within 1e-5 relative
  of torch.nn.utils.clip_grad_norm_'s, parameters after 5 clipped AdamW steps within 1e-5 x
  their largest absolute value.
- GPT with tied embeddings, tp=2 x pp=2 x dp=2 (8 ranks) through the pipeline executor,
  LayerNorm params replicated over tp, the tied embedding on the first and last stage: the
  norm of the step within 1e-5 relative of the single-device norm, stages 0-2.
"""
import torch

from multirank import run_on_ranks
from test_zero import BATCH, LR, STEPS, WD, assert_matches, full_params, train
from test_zero_gpt import SEED, gpt_batches, gpt_config
from zero_models import batches, reference_adamw, TinyLM, torch_param_groups

from gigatron.models.gpt import GPTModel
from gigatron.parallel.zero import ZeroConfig, build_zero
from gigatron.parallel.zero.grad_norm import clip_coefficient, global_norm_and_nonfinite

CLIP, RTOL = 0.2, 1e-5


def reference_norms():
    model = TinyLM()
    opt = torch.optim.AdamW(torch_param_groups(model, WD), lr=LR)
    norms = []
    for tokens, labels in batches(STEPS, BATCH):
        opt.zero_grad()
        model(tokens, labels).mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return norms


def _clipped(rank, world):
    out = {}
    for stage in range(4):
        model, zero, log = train(rank, world, stage, 1, clip_grad=CLIP)
        out[stage] = ([float(result.grad_norm) for result, _ in log], full_params(model, zero))
    return out


def test_dp2_grad_norm_and_clipping_match_single_device_all_stages():
    ref_norms, ref_params = reference_norms(), reference_adamw(STEPS, BATCH, LR, WD, CLIP)
    assert min(ref_norms) > CLIP  # every step clips: the test exercises clipping
    for res in run_on_ranks(_clipped, 2):
        for stage, (norms, params) in res.items():
            for got, want in zip(norms, ref_norms):
                assert abs(got - want) <= RTOL * want, (stage, norms, ref_norms)
            assert_matches(params, ref_params, what=f"clipped stage {stage}")


def test_clip_coefficient_follows_torch_convention():
    coefficient = clip_coefficient(torch.tensor(2.0), 1.0)
    assert isinstance(coefficient, torch.Tensor)  # stays on the device: no host read
    assert coefficient.item() == torch.tensor(1.0 / (2.0 + 1e-6)).item()
    assert clip_coefficient(torch.tensor(0.5), 1.0).item() == 1.0
    assert clip_coefficient(torch.tensor(5.0), 0.0).item() == 1.0


def gpt_micro_batches(dp_rank, per_rank=2, micro=2):
    tokens, labels = gpt_batches(1, batch=4 * micro)[0]
    out = []
    for i in range(per_rank):
        lo = (dp_rank * per_rank + i) * micro
        out.append({"input_ids": tokens[lo:lo + micro], "labels": labels[lo:lo + micro]})
    return out


def gpt_reference_norm():
    model = GPTModel(gpt_config(num_layers=4), seed=SEED)
    tokens, labels = gpt_batches(1, batch=8)[0]
    model(input_ids=tokens, labels=labels).mean().backward()
    return torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()


def _tp2_pp2_dp2(rank, world):
    from gigatron.parallel.pipeline.executor import PipelineExecutor
    from gigatron.models.pipeline_chunks import GPTMicroBatchStep, build_model_chunks
    from test_pipeline_gpt import p2p_for
    from gigatron.parallel.pipeline.partition import partition_layers
    from gigatron.parallel.pipeline.schedules import build_schedule
    from gigatron.parallel.topology import ProcessGroups, Topology

    groups = ProcessGroups(Topology(tp=2, dp=2, pp=2), rank)
    config = gpt_config(num_layers=4)
    pp_rank = groups.index("pp")
    norms = []
    for stage in (0, 1, 2):
        partition = partition_layers(config.num_layers, 2)
        chunks = build_model_chunks(config, partition, pp_rank, groups.tp, SEED)
        zero = build_zero(chunks, ZeroConfig(zero_stage=stage, lr=LR), groups)
        p2p = p2p_for(config, 2, groups.pp, groups.size("tp"))
        executor = PipelineExecutor(chunks, p2p, pp_rank, groups.ranks("pp"), grad_sync=zero,
                                    micro_batch_step=GPTMicroBatchStep())
        zero.zero_grad()
        executor.run(build_schedule(pp_rank, 2, 2), gpt_micro_batches(groups.index("dp")),
                     loss_scale=zero.loss_scale)
        norms.append(float(zero.step().grad_norm))
    return norms


def test_tp2_pp2_dp2_global_grad_norm_equals_single_device():
    want = gpt_reference_norm()
    for rank, norms in enumerate(run_on_ranks(_tp2_pp2_dp2, 8)):
        for stage, got in enumerate(norms):
            assert abs(got - want) <= RTOL * want, f"rank {rank} stage {stage}: {got} vs {want}"


def _fp64_norm(views):
    return sum(v.double().pow(2).sum() for v in views).sqrt().item()


def test_bf16_fp16_and_mixed_views_give_the_fp64_norm():
    """Issue 33: one multi-tensor kernel per dtype; bf16/fp16 grads still accumulate in fp32.
    200k bf16 values near 1: a norm rounded to bf16 would be ~1e-3 off, not 1e-6."""
    g = torch.Generator().manual_seed(7)
    big = (1 + torch.rand(200_000, generator=g)).bfloat16()
    bf16 = [big, torch.randn(300, 7, generator=g).bfloat16()[:, 2:5], big[:0]]
    mixed = bf16 + [torch.randn(1000, generator=g).half(), torch.randn(33, generator=g),
                    torch.randn(5, 5, generator=g, dtype=torch.float64)]
    for views in (bf16, mixed):
        norm, nonfinite = global_norm_and_nonfinite(views)
        assert norm.dtype == torch.float32 and nonfinite.item() == 0
        want = _fp64_norm(views)
        assert abs(norm.item() - want) <= 1e-6 * want, (norm.item(), want)


def test_nonfinite_count_covers_only_the_checked_views():
    grads = [torch.tensor([1.0, float("inf"), float("nan")]).half(), torch.ones(4).half()]
    norm, nonfinite = global_norm_and_nonfinite(grads[1:], check_views=grads)
    assert nonfinite.item() == 2 and norm.item() == 2.0
    _, none_checked = global_norm_and_nonfinite(grads)
    assert none_checked.item() == 0
