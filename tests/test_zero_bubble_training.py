"""The zero-bubble schedules train the same model as one rank (issue 29): a tiny fp32 GPT
pretrained for 2 iterations by the real program (pretrain.main on forked gloo ranks,
--mock-data) with --pipeline-schedule zb-h1 or zbv logs the one-rank run's losses at every
iteration and ends with its full parameters (tp slices gathered).

zb-h1 runs with tied embeddings (the tied copies' grads summed over the embedding group),
zbv with untied ones (it refuses tied: both copies would be chunks of pipeline rank 0).
Layouts: zb-h1 at pp2, pp4, pp2 x dp2 with ZeRO 1 and with ZeRO 2 and overlapped bucketed
grad reduction (the buckets start when a parameter's last W is done), pp2 x tp2 with sequence
parallelism, pp2 x cp2;
zbv at pp2, pp4 and pp2 x dp2; the MoE model at pp2 x ep2 with zb-h1. Recomputation rides
on the pp2 x dp2 layouts (no extra runs): zb-h1 ZeRO 1 with --recompute-granularity full
(uniform, 1 layer), zb-h1 ZeRO 2 with selective, zbv with full; each rank is checked to have
recomputed (the recomputed forward runs inside B, whose queue its linears defer to). Tolerance 1e-5
(absolute on losses, relative L2 on every full parameter); SGD, since Adam would blow the
key bias's zero-in-theory grads (float noise) up to full steps in any layout, 1f1b too.
Measured (CPU, torch 2.13, 2 iterations) in every layout: losses within 2.4e-7, every
parameter within 4.7e-7 (pp2 x ep2 MoE: 1.3e-7). Dropping the W's (tried on purpose) moves
the zb-h1 pp2 losses by 2e-2 and the parameters by 0.63. Enabling the grad sync at the last
B instead of the last W is NOT caught here (no bucket completes early in these layouts):
test_zero_bubble_schedules.py checks that rule hook by hook, test_wgrad.py each layer's split.
"""
from __future__ import annotations

import json

import pytest

from multirank import run_on_ranks

TOL = 1e-5
ITERS = 2  # the second step's losses are the first's update (a third cost ~1/4 of a run)
GPT = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
       "--micro-batch-size 2 --global-batch-size 16 --lr 0.05 --optimizer sgd --mock-data "
       "--vocab-size 128 "
       "--eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 --init-method-std 0.1 "
       "--hidden-dropout 0 --attention-dropout 0 --log-interval 1 --clip-grad 1.0 "
       f"--train-iters {ITERS} --lr-warmup-iters 0").split()
UNTIED = ["--untie-embeddings-and-output-weights"]
ZB_H1 = ["--pipeline-schedule", "zb-h1"]
ZBV = ["--pipeline-schedule", "zbv", "--untie-embeddings-and-output-weights"]
FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
SELECTIVE = ["--recompute-granularity", "selective"]
LAYOUTS = {  # name: (ranks, flags)
    "zbh1_pp2": (2, ZB_H1 + ["--pipeline-model-parallel-size", "2"]),
    "zbh1_pp4": (4, ZB_H1 + ["--pipeline-model-parallel-size", "4"]),
    "zbh1_pp2_dp2_zero1_recompute_full": (4, ZB_H1 + FULL + "--pipeline-model-parallel-size 2 "
                                          "--zero-stage 1 --overlap-grad-reduce "
                                          "--ddp-bucket-size 2000".split()),
    "zbh1_pp2_dp2_zero2_recompute_selective": (4, ZB_H1 + SELECTIVE + "--zero-stage 2 "
                                               "--pipeline-model-parallel-size 2 "
                                               "--overlap-grad-reduce --ddp-bucket-size "
                                               "2000".split()),
    "zbh1_pp2_cp2": (4, ZB_H1 + "--pipeline-model-parallel-size 2 "
                                "--context-parallel-size 2".split()),
    "zbh1_pp2_tp2_sp": (4, ZB_H1 + "--pipeline-model-parallel-size 2 "
                                   "--tensor-model-parallel-size 2 --sequence-parallel".split()),
    "zbv_pp2": (2, ZBV + "--pipeline-model-parallel-size 2 "
                         "--num-layers-per-virtual-pipeline-stage 1".split()),
    "zbv_pp4": (4, ZBV + "--pipeline-model-parallel-size 4 --num-layers 8 "
                         "--num-layers-per-virtual-pipeline-stage 1".split()),
    "zbv_pp2_dp2_recompute_full": (4, ZBV + FULL + "--pipeline-model-parallel-size 2 "
                                   "--num-layers-per-virtual-pipeline-stage 1".split()),
}


def _train_layout(rank, world, argv, metrics):
    """pretrain.main(argv); this rank's parameters after the last step (tp gathered)."""
    from gigatron.parallel.tensor import gather_full_parameter
    from gigatron.training.run import loop, pretrain

    real_train, captured = loop.train, {}

    def train(session, progress):
        result = real_train(session, progress)
        captured["params"] = {
            name: gather_full_parameter(p, session.groups.tp).detach().clone()
            for chunk in session.chunks for name, p in chunk.named_parameters()}
        return result

    loop.train = train
    recomputed = _count_recompute() if "--recompute-granularity" in argv else None
    assert pretrain.main(argv + ["--metrics-file", metrics]) == 0
    assert recomputed is None or recomputed[0] > 0, "nothing was recomputed"
    return captured["params"]


def _count_recompute():
    """Count the model's activation checkpoints (this forked rank only)."""
    from gigatron.models import transformer

    real, calls = transformer.checkpoint, [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    transformer.checkpoint = counted
    return calls


def _losses(path):
    with open(path) as f:
        return [r["lm loss"] for r in map(json.loads, f) if r["type"] == "train"]


def _merged(per_rank):
    full = {}
    for params in per_rank:
        full.update(params)
    return full


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One rank's losses and parameters: tied (zb-h1) and untied (zbv), 4 and 8 layers."""
    out = {}
    for key, flags in {("tied", 4): [], ("untied", 4): UNTIED,
                       ("untied", 8): UNTIED + ["--num-layers", "8"]}.items():
        metrics = str(tmp_path_factory.mktemp("one_rank") / "one.jsonl")
        params = run_on_ranks(_train_layout, 1, GPT + flags, metrics, timeout=300)[0]
        out[key] = (params, _losses(metrics))
        assert len(out[key][1]) == ITERS
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_zero_bubble_schedule_trains_the_one_rank_model(references, tmp_path, layout):
    ranks, flags = LAYOUTS[layout]
    metrics = str(tmp_path / "metrics.jsonl")
    per_rank = run_on_ranks(_train_layout, ranks, GPT + flags, metrics, timeout=300)
    kind = ("untied" if "--untie-embeddings-and-output-weights" in flags else "tied",
            8 if "8" in flags else 4)
    ref_params, ref_losses = references[kind]
    losses = _losses(metrics)
    assert len(losses) == ITERS
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    params = _merged(per_rank)
    # pp with tied embeddings: the last stage's copy of the output weight (the embedding's)
    assert set(ref_params) <= set(params) and \
        set(params) - set(ref_params) <= {"output_layer.weight"}
    error = {n: ((params[n] - ref_params[n]).norm() / ref_params[n].norm()).item()
             for n in ref_params}
    worst = max(error, key=error.__getitem__)
    assert error[worst] <= TOL, (worst, error[worst])
    assert losses[0] != losses[-1]  # it trained


def _problems(argv, world):
    """The validation error pretrain_gpt.py would print for argv at `world` ranks."""
    from gigatron.training.config.arguments import build_run_config, parse_flags
    from gigatron.training.config.validation import ConfigError

    with pytest.raises(ConfigError) as error:
        build_run_config(parse_flags(argv, "pretrain_gpt.py"), world, None)
    return str(error.value)


def test_bad_zero_bubble_layouts_get_one_line_naming_the_flags():
    pp2 = GPT + ["--pipeline-model-parallel-size", "2"]
    tied = _problems(pp2 + ["--pipeline-schedule", "zbv",
                            "--num-layers-per-virtual-pipeline-stage", "1"], 2)
    assert "--pipeline-schedule zbv needs --untie-embeddings-and-output-weights" in tied
    assert "exactly 2 chunks per stage" in _problems(pp2 + ZBV, 2)
    assert "--zero-stage 0, 1 or 2" in _problems(GPT + ZB_H1 + ["--zero-stage", "3"], 1)
    assert "zb-h1 runs one chunk per stage" in _problems(
        pp2 + ZB_H1 + ["--num-layers-per-virtual-pipeline-stage", "1"], 2)


def test_zb_h1_trains_the_one_rank_moe_model_at_pp2_ep2(tmp_path):
    """The MoE layers (router and experts compute their weight grads in B, the attention's
    linears defer theirs to W) under zb-h1 with expert parallelism."""
    from test_moe_parallel import (ALLTOALL, SHORT, STEPS, _full_parameters, _relative,
                                   one_rank_reference)
    from test_moe_parallel import _losses as moe_losses
    from test_moe_parallel import _train_layout as moe_layout

    ref, ref_losses = one_rank_reference(tuple(SHORT + ALLTOALL))
    flags = ("--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 "
             "--pipeline-schedule zb-h1").split()
    four = str(tmp_path / "four.jsonl")
    got = _full_parameters(run_on_ranks(moe_layout, 4, SHORT + ALLTOALL + flags, four,
                                        timeout=300))
    assert len(moe_losses(four)) == len(ref_losses) == STEPS
    for mine, want in zip(moe_losses(four), ref_losses):
        assert all(abs(mine[k] - want[k]) <= TOL for k in want), (mine, want)
    assert max(_relative(got[n], ref[n]) for n in ref) <= TOL


def test_delay_wgrad_compute_is_accepted_with_zero_bubble_and_refused_with_1f1b():
    """Megatron-Core's --delay-wgrad-compute: what zb-h1/zbv always do (accepted, no further
    effect); 1f1b and interleaved compute weight grads in the backward (one line)."""
    from gigatron.training.config.arguments import build_run_config, parse_flags

    pp2 = GPT + ["--pipeline-model-parallel-size", "2", "--delay-wgrad-compute"]
    for flags in (ZB_H1, ZBV + ["--num-layers-per-virtual-pipeline-stage", "1"]):
        run = build_run_config(parse_flags(pp2 + flags, "pretrain_gpt.py"), 2, None)
        assert run.parallel.delay_wgrad_compute
    for flags, name in (([], "1f1b"), (["--num-layers-per-virtual-pipeline-stage", "1"],
                                       "1f1b"),
                        (["--pipeline-schedule", "interleaved",
                          "--num-layers-per-virtual-pipeline-stage", "1"], "interleaved")):
        problems = _problems(pp2 + flags, 2)
        assert (f"--delay-wgrad-compute needs a schedule that runs weight gradients apart: use "
                f"--pipeline-schedule zb-h1 or zbv (--pipeline-schedule {name} computes them "
                f"in the backward)") in problems, problems
