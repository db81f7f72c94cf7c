"""--optimizer muon trains the same model in every layout (the real program: pretrain.main on
forked gloo ranks, --mock-data, fp32, --muon-fp32-matmul-prec high so the iterations are fp32).

Dense (RoPE, GQA with 2 query groups so q, k and v split unevenly, SwiGLU so fc1 is a strided
tp matrix): the one-rank run of 3 iterations saving at 2; tp2 x pp2 logs its losses and ends
with its parameters within 1e-4 (measured 7e-7); its checkpoint of iteration 2 resumes on one
rank exactly (losses and parameters equal) and at tp2 x dp2 with the distributed optimizer
(every matrix gathered over tp, owned by one dp rank: the layer-wise scheme) as the
uninterrupted run (measured 7e-8): the resumed step's loss reads the loaded weights, the
parameters after it the loaded momentum (two steps' gradients: not the last one alone).
Mixture of experts (4 experts, a shared expert, balancing losses; 2 iterations, as
tests/test_moe_parallel.py's): ep2 x dp2 with --use-distributed-optimizer (experts'
matrices owned over the expert-data-parallel group) and tp2 x ep2 with expert-tp 2, sequence
parallelism and --muon-tp-mode distributed (every matrix left sharded over tp or expert-tp,
its norm and Gram matrices summed) equal the one-rank run."""
import pytest

from multirank import run_on_ranks
from test_context_parallel import GPT, ROPE, _relative
from test_context_parallel_checkpoint import _launch, _loss_error
from test_moe_parallel import SHORT, _full_parameters
from test_moe_parallel import _losses as _moe_losses
from test_moe_parallel import _train_layout as _train_moe_layout

TOL = 1e-4
ITERS, SAVED_AT = 3, 2
MUON = "--optimizer muon --muon-fp32-matmul-prec high".split()
DENSE = [f for f in GPT if f != "--eod-mask-loss"] + ROPE + MUON + \
    "--group-query-attention --num-query-groups 2 --swiglu".split()
DENSE[DENSE.index("--train-iters") + 1] = str(ITERS)
DENSE += ["--save-interval", str(SAVED_AT)]
MOE_LAYOUTS = {
    "ep2_dp2_distributed_optimizer": "--expert-model-parallel-size 2 "
                                     "--use-distributed-optimizer".split(),
    "tp2_ep2_etp2_sp_distributed": "--tensor-model-parallel-size 2 --sequence-parallel "
                                   "--expert-model-parallel-size 2 "
                                   "--muon-tp-mode distributed".split(),
}


def _worst(got, want):
    """Largest relative parameter error (pp's last stage also holds the tied output copy)."""
    assert set(want) <= set(got)
    return max(_relative(got[n], want[n]) for n in want)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """(checkpoint folder, losses, parameters) of the uninterrupted one-rank dense run."""
    folder = str(tmp_path_factory.mktemp("one"))
    losses, _, params = _launch(1, DENSE + ["--save", folder], folder)
    assert len(losses) == ITERS
    return folder, losses, params


def test_tp2_pp2_trains_the_one_rank_model(one_rank, tmp_path):
    _, want_losses, want = one_rank
    losses, _, params = _launch(4, DENSE + "--tensor-model-parallel-size 2 "
                                "--pipeline-model-parallel-size 2".split(), str(tmp_path))
    errors = _loss_error(losses, want_losses), _worst(params, want)
    print(f"tp2 x pp2: loss error {errors[0]:.2e}, parameter error {errors[1]:.2e}")
    assert max(errors) <= TOL, errors


@pytest.mark.parametrize("world, flags, tolerance", [
    (1, [], 0.0),
    (4, "--tensor-model-parallel-size 2 --use-distributed-optimizer".split(), TOL)],
    ids=["same_layout", "tp2_dp2_distributed_optimizer"])
def test_the_checkpoint_holds_the_momentum_and_resumes_in_any_layout(one_rank, tmp_path,
                                                                      world, flags, tolerance):
    folder, want_losses, want = one_rank
    losses, _, params = _launch(world, DENSE + flags + ["--load", folder, "--ckpt-step",
                                                        str(SAVED_AT)], str(tmp_path))
    assert len(losses) == ITERS - SAVED_AT
    errors = _loss_error(losses, want_losses[SAVED_AT:]), _worst(params, want)
    print(f"resumed at {world} ranks {flags}: loss error {errors[0]:.2e}, parameter error "
          f"{errors[1]:.2e}")
    assert max(errors) <= tolerance, errors


def _moe_run(ranks, argv, metrics):
    return _full_parameters(run_on_ranks(_train_moe_layout, ranks, argv, metrics,
                                         timeout=300)), _moe_losses(metrics)


@pytest.fixture(scope="module")
def moe_one_rank(tmp_path_factory):
    return _moe_run(1, SHORT + MUON + ["--moe-token-dispatcher-type", "alltoall"],
                    str(tmp_path_factory.mktemp("moe") / "one.jsonl"))


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_layout_trains_the_one_rank_model(moe_one_rank, tmp_path, layout):
    want, want_losses = moe_one_rank
    params, losses = _moe_run(4, SHORT + MUON + ["--moe-token-dispatcher-type", "alltoall"] +
                              MOE_LAYOUTS[layout], str(tmp_path / "metrics.jsonl"))
    assert len(losses) == len(want_losses)
    loss_error = max(abs(a[k] - b[k]) / abs(b[k]) for a, b in zip(losses, want_losses)
                     for k in b)
    param_error = max(_relative(params[n], want[n]) for n in want)
    print(f"{layout}: loss error {loss_error:.2e}, parameter error {param_error:.2e}")
    assert loss_error <= TOL and param_error <= TOL, (loss_error, param_error)
