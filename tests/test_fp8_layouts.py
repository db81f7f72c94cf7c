"""Every layout equals one rank in FP8 (DESIGN decision 15): a tiny fp32 GPT with
--fp8-format hybrid, pretrained for a few iterations by the real program (pretrain.main on
forked gloo ranks, --mock-data), logs the one-rank FP8 run's LM losses and ends with its full
parameters at pp2, dp2 (ZeRO 1), cp2, tp2 x dp2 (ZeRO 1, --fp8-param-gather) and, for an MoE
GPT, ep2 (tensorwise), and at pp2, cp2 and dp2 (ZeRO 1, --fp8-param-gather) under delayed
scaling.

Why they can be equal: tensorwise scaling MAX-reduces each operand's amax over tp x cp (a
cp chunk of tokens is quantised as the whole sequence is), and nothing over dp or pp (each
micro-batch quantised on its own, as on one rank). Delayed scaling MAX-reduces the amax
history over the stage's tp x cp x dp ranks (TE's amax reduction group): a dp2 step then
quantises with the amax of the whole global batch, which equals one rank only when that
rank runs the global batch as one micro-batch, so the delayed runs compare dp2 (micro-batch
2) and cp2 against one rank at micro-batch 4, one micro-batch a step, with
--calculate-per-token-loss (the output-gradients keep one rank's magnitude: with per-rank
means they would be 2x, and delayed scaling's first step, scale 1, rounds 2x in E5M2's
subnormals differently). The delayed dp2 run also has --fp8-param-gather.

Delayed scaling's first step quantises with scale 1 (TE's DelayedScaling, kept here), so
a layout whose loss normalisation differs from one rank's by a power of two -- cp: each
rank's loss x cp, its gradients averaged over dp x cp, as Megatron -- rounds the first
step's output-gradients differently where they fall in E5M2's subnormals (below 2**-14);
from the second step the scales absorb the factor exactly. Measured at cp2 on this model:
0.27 relative on a layer-norm bias after 3 steps, 1.3e-7 once the first backward scale is
2**12 (every gradient in E5M2's normal range). So the delayed runs start their backward
scales at 2**12 (`_normal_first_step`), which isolates what the layout decides -- the amax
reduction over tp x cp x dp -- from that first-step rounding (docs/FP8.md).

In the MoE layers the attention and shared-expert linears run in FP8; the routed experts
(stacked weights, not tensor-parallel linears) stay in the run's dtype.

Measured (CPU, torch 2.13, 3 iterations; loss error, parameter error): pp2 tensorwise 0 and
5.9e-8, dp2 ZeRO 1 tensorwise 1.0e-7 and 7.8e-8, cp2 tensorwise 1.0e-7 and 2.5e-7, cp2
delayed 4.9e-8 and 1.3e-7, pp2 delayed (4 micro-batches of 1) 0 and 2.4e-8, dp2 ZeRO 1
delayed with --fp8-param-gather 1.0e-7 and 1.3e-7, tp2 x dp2 ZeRO 1 tensorwise with
--fp8-param-gather 1.0e-7 and 4.4e-7 (its gather's amax not reduced over tp, tried: 2.8e-4
and 0.09), ep2 MoE tensorwise 9.6e-8 and 2.7e-6. With the amax reduced over tp only (the cp and dp
reductions dropped, tried on purpose): cp2 tensorwise 0.49, cp2 delayed 0.084, dp2 delayed
0.043 on the parameters.
"""
from __future__ import annotations

import json

import pytest
import torch

from multirank import run_on_ranks
from test_moe_parallel import ALLTOALL, MOE, _full_parameters
from test_moe_parallel import _train_layout as _train_moe_layout
from test_context_parallel import _train_layout as _train_dense_layout

RTOL = 1e-4
ITERS = 3
GPT = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
       "--max-position-embeddings 16 --lr 3e-3 --mock-data --vocab-size 128 --eval-iters 0 "
       "--no-progress --make-vocab-size-divisible-by 8 --init-method-std 0.1 "
       "--hidden-dropout 0 --attention-dropout 0 --disable-bias-linear --log-interval 1 "
       "--position-embedding-type rope --clip-grad 0.05 "
       f"--train-iters {ITERS} --lr-warmup-iters 0 --fp8-format hybrid").split()
TENSORWISE = "--fp8-recipe tensorwise --micro-batch-size 2 --global-batch-size 8".split()
DELAYED = ("--fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max "
           "--calculate-per-token-loss --global-batch-size 4").split()
MOE_FP8 = [str(ITERS) if MOE[i - 1] == "--train-iters" else a for i, a in enumerate(MOE)] + \
    ALLTOALL + "--fp8-format hybrid --fp8-recipe tensorwise".split()
ONE_MICRO_BATCH = GPT + DELAYED + ["--micro-batch-size", "4"]
# layout -> (ranks, the one-rank reference's flags, the layout's flags)
LAYOUTS = {
    "pp2_tensorwise": (2, GPT + TENSORWISE,
                       GPT + TENSORWISE + ["--pipeline-model-parallel-size", "2"]),
    "dp2_zero1_tensorwise": (2, GPT + TENSORWISE, GPT + TENSORWISE + ["--zero-stage", "1"]),
    "cp2_tensorwise": (2, GPT + TENSORWISE,
                       GPT + TENSORWISE + ["--context-parallel-size", "2"]),
    "tp2_dp2_zero1_tensorwise_fp8_param_gather": (
        4, GPT + TENSORWISE, GPT + TENSORWISE + "--tensor-model-parallel-size 2 --zero-stage 1 "
                                                "--fp8-param-gather".split()),
    "cp2_delayed": (2, ONE_MICRO_BATCH, ONE_MICRO_BATCH + ["--context-parallel-size", "2"]),
    "pp2_delayed": (2, GPT + DELAYED + ["--micro-batch-size", "1"], GPT + DELAYED + [
        "--micro-batch-size", "1", "--pipeline-model-parallel-size", "2"]),
    "dp2_zero1_delayed_fp8_param_gather": (
        2, ONE_MICRO_BATCH, GPT + DELAYED + "--micro-batch-size 2 --use-distributed-optimizer "
                                            "--fp8-param-gather".split()),
    "ep2_moe_tensorwise": (2, MOE_FP8, MOE_FP8 + ["--expert-model-parallel-size", "2"]),
}


def _losses(path):
    with open(path) as f:
        return [r["lm loss"] for r in map(json.loads, f) if r["type"] == "train"]


FIRST_BACKWARD_SCALE = 2.0 ** 12


def _normal_first_step(rank, world, train_layout, argv, metrics):
    """`train_layout` with every delayed backward scale starting at FIRST_BACKWARD_SCALE
    instead of 1 (the module doc says why)."""
    from gigatron.parallel.tensor import fp8

    build = fp8.FP8LinearState.__init__

    def init(self, *args, **kwargs):
        build(self, *args, **kwargs)
        self.backward.scale.fill_(FIRST_BACKWARD_SCALE)

    fp8.FP8LinearState.__init__ = init  # in this forked rank only
    return train_layout(rank, world, argv, metrics)


def _train(ranks, argv, metrics):
    """Full parameters after training `argv` on `ranks`, and the logged losses."""
    train = _train_moe_layout if "--num-experts" in argv else _train_dense_layout
    if "delayed" in argv:
        per_rank = run_on_ranks(_normal_first_step, ranks, train, argv, metrics, timeout=300)
    else:
        per_rank = run_on_ranks(train, ranks, argv, metrics, timeout=300)
    if "--num-experts" in argv:
        return _full_parameters(per_rank), _losses(metrics)
    params = {}
    for rank_params in per_rank:
        params.update(rank_params)  # pp stages hold different names
    return params, _losses(metrics)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The one-rank FP8 run of a reference's flags, built on first use."""
    cache = {}

    def get(flags):
        key = tuple(flags)
        if key not in cache:
            cache[key] = _train(1, flags, str(tmp_path_factory.mktemp("one") / "one.jsonl"))
        return cache[key]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_layout_trains_the_one_rank_fp8_model(references, tmp_path, layout):
    """Tolerance 1e-4 relative on losses and on every full parameter (L2 of the difference
    over L2 of the one-rank value); with --fp8-param-gather the FP8 linears' weights hold
    their dequantised FP8 values: the other parameters are compared, and these are checked
    to be FP8-rounded (some off by more than 1e-3, none by E4M3's 2**-4)."""
    ranks, reference, flags = LAYOUTS[layout]
    ref_params, ref_losses = references(reference)
    params, losses = _train(ranks, flags, str(tmp_path / "metrics.jsonl"))
    assert len(losses) == len(ref_losses) == ITERS
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert set(params) - set(ref_params) <= {"output_layer.weight"}  # pp: the tied copy
    compared = [n for n in ref_params if not ("--fp8-param-gather" in flags
                                              and ".linear_" in n)]
    param_error = max(((params[n] - ref_params[n]).norm()
                       / ref_params[n].norm().clamp(min=1e-30)).item() for n in compared)
    print(f"{layout}: loss error {loss_error:.2e}, param error {param_error:.2e}")
    assert loss_error <= RTOL and param_error <= RTOL, (loss_error, param_error)
    if "--fp8-param-gather" in flags:  # the FP8 weights were published: FP8-rounded values
        errors = {n: ((params[n] - ref_params[n]).norm() / ref_params[n].norm()).item()
                  for n in set(ref_params) - set(compared)}
        # fp32 masters alias the parameters: each rank's own shard keeps its exact values
        assert max(errors.values()) > 1e-3 and max(errors.values()) < 2 ** -4, errors
    assert torch.isfinite(torch.tensor(losses)).all()
