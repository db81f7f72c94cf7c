"""Experts with biases (Megatron's default --add-bias-linear, as Megatron-Core builds them: a
router bias, per-expert fc1 and fc2 biases) train the same model in every expert layout as on
one rank, and their checkpoints are layout-free.

A tiny Mixtral-shaped MoE GPT (the one of test_moe_checkpoint.py, without
--disable-bias-linear) trains 4 iterations on one rank, saving at 2. On 4 forked gloo ranks,
tp2 x ep2 at etp 2 with sequence parallelism and ZeRO-1 (each etp rank holds a slice of
every expert's fc1 bias, SwiGLU's halves each sliced, and of its fc2 bias's hidden columns:
the etp sum adds the fc2 bias once) resumes from the one-rank checkpoint (its biases' boxes
read back) and logs the one-rank losses of iterations 3-4 and ends with its full parameters
within 1e-5 (relative L2 per parameter). An fc2 bias added in the wrong columns misses by
0.19 (the parameters) and 7e-3 (the losses).
"""
from __future__ import annotations

import pytest

from test_moe_checkpoint import MIXTRAL, SAVED_AT, _launch, _loss_error, _worst

TOL = 1e-5
# --adam-eps: a near-zero gradient (the key biases', an element here and there) would take
# an lr-sized first Adam step on float noise, which differs between layouts
BIASED = [a for a in MIXTRAL if a != "--disable-bias-linear"] + ["--adam-eps", "1e-4"]
TP2_EP2_ETP2 = ("--tensor-model-parallel-size 2 --sequence-parallel "
                "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall "
                "--moe-grouped-gemm").split()


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("one_rank"))
    losses, params = _launch(1, BIASED + ["--save", folder], folder)
    names = set(params)
    for suffix in ("mlp.router.bias", "mlp.experts.bias1", "mlp.experts.bias2"):
        assert any(n.endswith(suffix) for n in names), suffix
    return folder, losses, params


def test_biased_experts_resume_at_tp2_ep2_etp2_as_the_one_rank_run(one_rank, tmp_path):
    folder, one_losses, one_params = one_rank
    losses, params = _launch(4, BIASED + TP2_EP2_ETP2 + [
        "--zero-stage", "1", "--load", folder, "--ckpt-step", str(SAVED_AT)], str(tmp_path))
    assert len(losses) == len(one_losses) - SAVED_AT
    loss_error = _loss_error(losses, one_losses[SAVED_AT:])
    param_error = _worst(params, one_params)
    assert loss_error <= TOL and param_error <= TOL, (loss_error, param_error)
