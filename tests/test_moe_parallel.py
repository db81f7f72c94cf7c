"""Expert parallelism trains the same model as one device: a tiny fp32 MoE GPT (SwiGLU experts,
top-2 of 4, aux loss and z-loss on, dropless, a shared expert) pretrained for 2 iterations
by the real program (pretrain.main on forked gloo ranks, --mock-data) in each layout logs the
one-rank run's LM loss and balancing losses at every iteration, and ends with the one-rank
run's full parameters (expert boxes put back together over ep and etp, tp slices gathered).

Layouts (4 ranks): ep4 (dp 4) with both dispatchers, tp2 x ep2 with sequence parallelism at
etp 1 (grouped, allgather) and etp 2 (with and without --moe-grouped-gemm), pp2 x ep2 (ZeRO 0),
ZeRO stages 1, 2, 3 at ep2 x edp2 (dp 4). Tolerance 1e-4 relative on losses and on every full parameter (L2 of
the difference over L2 of the one-rank value). Measured (CPU, torch 2.13, 2 iterations):
losses within 6.7e-8 in every layout; parameters within 1.4e-7 (ep, pp, ZeRO layouts) and
5.7e-7 (tp2 x ep2). The grad norm (~1.2) is above --clip-grad 1.0, so every step clips: a
norm that counted an expert twice or missed one would move every parameter. Expert grads
averaged over edp instead of dp (a bug tried on purpose, ZeRO 1) give a 5.3e-4 parameter
error (the losses alone moved only 2e-7: the parameters are the sharper check).
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from typing import Tuple

import pytest
import torch

from multirank import run_on_ranks

RTOL = 1e-4
ITERS = 4  # MOE's, as the files that import it train it
MOE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
       "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --mock-data --vocab-size 128 "
       "--eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 --init-method-std 0.1 "
       "--disable-bias-linear --swiglu --num-experts 4 --moe-ffn-hidden-size 16 "
       "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --hidden-dropout 0 "
       "--attention-dropout 0 --moe-shared-expert-intermediate-size 16 --log-interval 1 "
       f"--train-iters {ITERS} --lr-warmup-iters 0").split()
# The layouts here (and the MoE runs of tests/test_context_parallel_checkpoint.py and
# tests/test_zero_bubble_training.py) train 2 iterations: Adam's second update weighs the two
# steps' gradients against each other, so a gradient of the wrong size shows from the second
# (expert grads averaged over edp instead of dp, tried at ZeRO 1: 5.3e-4 after 2 iterations,
# 1.1e-3 after 4); the last two iterations cost ~1/4 of a 4-rank run's CPU.
STEPS = 2
SHORT = list(MOE)  # MOE, trained STEPS iterations
SHORT[SHORT.index("--train-iters") + 1] = str(STEPS)
ALLTOALL = ["--moe-token-dispatcher-type", "alltoall"]
ALLGATHER = ["--moe-token-dispatcher-type", "allgather"]
LAYOUTS = {
    "ep4_allgather": ["--expert-model-parallel-size", "4"] + ALLGATHER,
    "ep4_alltoall_grouped": ["--expert-model-parallel-size", "4", "--moe-grouped-gemm"]
    + ALLTOALL,
    "tp2_ep2_etp1_sp_grouped": "--tensor-model-parallel-size 2 --sequence-parallel "
                               "--expert-model-parallel-size 2 --expert-tensor-parallel-size 1 "
                               "--moe-grouped-gemm".split() + ALLGATHER,
    "tp2_ep2_etp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel "
                       "--expert-model-parallel-size 2".split() + ALLTOALL,
    "tp2_ep2_etp2_sp_grouped": "--tensor-model-parallel-size 2 --sequence-parallel "
                               "--expert-model-parallel-size 2 --moe-grouped-gemm".split()
    + ALLGATHER,
    "pp2_ep2": "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2".split()
    + ALLTOALL,
    "zero1_ep2": "--expert-model-parallel-size 2 --zero-stage 1".split() + ALLTOALL,
    "zero2_ep2": "--expert-model-parallel-size 2 --zero-stage 2".split() + ALLGATHER,
    "zero3_ep2": "--expert-model-parallel-size 2 --zero-stage 3".split() + ALLTOALL,
}


def _local_parameters(chunks, groups):
    """name -> (this rank's tensor, expert splits or None), tp slices gathered over tp."""
    from gigatron.parallel.tensor import gather_full_parameter

    out = {}
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if getattr(param, "expert_parallel", False):
                out[name] = (param.detach().clone(), getattr(param, "expert_splits"))
            else:
                out[name] = (gather_full_parameter(param, groups.tp).detach().clone(), None)
    return out


def _train_layout(rank, world, argv, metrics):
    """pretrain.main(argv) (it leaves the process group at its end: one run per launch);
    this rank's parameters after the last step."""
    from gigatron.training.run import loop, pretrain

    real_train, captured = loop.train, {}

    def train(session, progress):
        result = real_train(session, progress)
        with session.zero.gathered_parameters() if session.zero.stage == 3 else _nothing():
            captured["params"] = _local_parameters(session.chunks, session.groups)
        return result

    loop.train = train
    assert pretrain.main(argv + ["--metrics-file", metrics]) == 0
    return captured["params"]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def train_and_gather(ranks, argv, metrics):
    """The full parameters after training `argv` on `ranks` (experts gathered over ep when
    argv has --num-experts; pp stages' names merged), for tests that compare layouts."""
    if "--num-experts" in argv:
        return _full_parameters(run_on_ranks(_train_layout, ranks, argv, metrics, timeout=300))
    from test_context_parallel import _train_layout as _train_dense_layout

    params = {}
    for rank_params in run_on_ranks(_train_dense_layout, ranks, argv, metrics, timeout=300):
        params.update(rank_params)  # pp stages hold different names
    return params


def _full_parameters(per_rank):
    """Every rank's pieces -> name -> full tensor (expert boxes placed into the full one)."""
    from gigatron.parallel.tensor.init import unshard

    full, boxes = {}, {}
    for params in per_rank:
        for name, (tensor, splits) in params.items():
            if splits is None:
                full[name] = tensor
            else:
                (_, ep_rank, ep, _), (dim, etp_rank, etp, stride) = splits
                boxes.setdefault(name, {})[(ep_rank, etp_rank)] = (tensor, ep, etp, dim, stride)
    for name, by_box in boxes.items():
        _, ep, etp, dim, stride = next(iter(by_box.values()))
        full[name] = torch.cat([unshard([by_box[(e, t)][0] for t in range(etp)], dim, stride)
                                for e in range(ep)])
    return full


def _losses(path):
    with open(path) as f:
        records = [r for r in map(json.loads, f) if r["type"] == "train"]
    return [{k: r[k] for k in ("lm loss", "load_balancing_loss", "z_loss") if k in r}
            for r in records]


def _relative(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


@functools.lru_cache(maxsize=None)
def one_rank_reference(argv: Tuple[str, ...]):
    """(full parameters, losses) of `argv` trained on one rank, once per process: the MoE
    tests of other files ask for SHORT + ALLTOALL too. Callers must not modify them."""
    with tempfile.TemporaryDirectory() as folder:
        metrics = os.path.join(folder, "one.jsonl")
        params = run_on_ranks(_train_layout, 1, list(argv), metrics, timeout=300)[0]
        return _full_parameters([params]), _losses(metrics)


@pytest.fixture(scope="module")
def reference():
    params, losses = one_rank_reference(tuple(SHORT + ALLTOALL))
    assert len(losses) == STEPS and {"lm loss", "load_balancing_loss", "z_loss"} <= \
        set(losses[0])
    return params, losses


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_layout_trains_the_one_device_model(reference, tmp_path, layout):
    ref_params, ref_losses = reference
    metrics = str(tmp_path / "metrics.jsonl")
    per_rank = run_on_ranks(_train_layout, 4, SHORT + LAYOUTS[layout], metrics, timeout=300)
    losses = _losses(metrics)
    assert len(losses) == STEPS
    loss_error = max(abs(got[k] - want[k]) / abs(want[k])
                     for got, want in zip(losses, ref_losses) for k in want)
    params = _full_parameters(per_rank)
    # pp: the last stage's copy of the tied output weight (the embedding's equal)
    assert set(params) - set(ref_params) <= {"output_layer.weight"}
    assert set(ref_params) <= set(params)
    param_error = max(_relative(params[n], ref_params[n]) for n in ref_params)
    assert loss_error <= RTOL and param_error <= RTOL, (loss_error, param_error)
