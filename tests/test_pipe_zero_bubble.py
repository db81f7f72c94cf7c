"""gigatron.pipe's PipelineModule under the zero-bubble schedules (issue 29): a user's own
transformer (tests/pipe_user_model.py: tied embeddings, nn.Linear blocks) built with
`PipelineModule(..., schedule="zb-h1")` or `schedule="zbv"` and trained through
gigatron.initialize and train_batch at pp2 equals the same model under 1F1B at pp2 step by
step (losses and every final parameter within 1e-5, fp32, AdamW), on forked gloo ranks. The
split is real: under zb-h1 and zbv the Linears' weight gradients are deferred to W (counted),
under 1F1B none are. zbv's V is real: rank 0 holds the first and the last of the 4 chunks
(zbv refuses a tied embedding, as pretrain_gpt.py does: its twin has its own output weight).
Its checkpoint is layout-free:
saved under zbv, loaded at 1F1B pp2, the next step's loss equals zbv's own next step.
Bad schedules get one line naming the argument.
"""
import pytest
import torch

import pipe_user_model as um
from multirank import run_on_ranks
from test_pipeline_user_model import ATOL, GLOBAL_MICRO, RTOL, STEPS, config


def _train(net, folder=None):
    """Losses of STEPS steps, the final state, the W count; with `folder`: saved there, and
    the loss of one step more."""
    import gigatron
    from gigatron.parallel.tensor import wgrad

    gas = GLOBAL_MICRO // net.dp_size
    engine, _, _, _ = gigatron.initialize(model=net, config=config(gas))
    deferred, real = [0], wgrad._accumulate_weight_grad

    def counted(*args):
        deferred[0] += 1
        real(*args)

    wgrad._accumulate_weight_grad = counted
    try:
        losses = [float(engine.train_batch(iter([um.micro_batch(step, j) for j in range(gas)])))
                  for step in range(STEPS)]
    finally:
        wgrad._accumulate_weight_grad = real
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    next_loss = None
    if folder is not None:
        engine.save_checkpoint(folder)
        next_loss = float(engine.train_batch(iter([um.micro_batch(STEPS, j)
                                                   for j in range(gas)])))
    return losses, state, deferred[0], next_loss


class Head(um.Embed):
    """The output projection with its own weight (zbv refuses tied embeddings)."""

    def forward(self, hidden):
        return um.lm_head(self, hidden)


def untied_layers():
    from gigatron.pipe import LayerSpec

    return um.layers()[:-1] + [LayerSpec(Head, um.VOCAB, um.HIDDEN)]


def _schedules(rank, world, folder):
    """{schedule: run} of the same model at pp2 (tied; untied for zbv and its 1f1b twin);
    zbv's layers per chunk; the zbv checkpoint's next step loaded at 1f1b."""
    import gigatron
    from gigatron.pipe import PipelineModule

    def build(schedule, layers):
        return PipelineModule(layers(), num_stages=world, loss_fn=um.loss_fn,
                              seed_layers=True, schedule=schedule)

    runs = {name: _train(build(name, um.layers)) for name in ("1f1b", "zb-h1")}
    runs["1f1b untied"] = _train(build("1f1b", untied_layers))
    zbv = build("zbv", untied_layers)
    runs["zbv"] = _train(zbv, folder)
    chunks = [stage.layer_indices for stage in zbv.chunks]
    engine = gigatron.initialize(model=build("1f1b", untied_layers),
                                 config=config(GLOBAL_MICRO // zbv.dp_size))[0]
    engine.load_checkpoint(folder)
    loaded = float(engine.train_batch(iter([um.micro_batch(STEPS, j)
                                            for j in range(GLOBAL_MICRO)])))
    return runs, chunks, loaded


def _assert_same_run(run, reference, what, params, reference_params):
    """Losses, final parameters (`params`: of every rank) and the W counts of two runs."""
    torch.testing.assert_close(torch.tensor(run[0]), torch.tensor(reference[0]), rtol=RTOL,
                               atol=ATOL)
    assert reference[0][0] != reference[0][-1]  # it trained
    assert set(params) == set(reference_params)
    for name, value in reference_params.items():
        torch.testing.assert_close(params[name], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, n=name: f"{what} {n}: {m}")
    # 2 blocks on each rank x 4 Linears x 8 micro-batches x 3 steps deferred to W
    assert reference[2] == 0 and run[2] == 2 * 4 * GLOBAL_MICRO * STEPS, (what, run[2])


def test_zero_bubble_schedules_at_pp2_train_as_1f1b(tmp_path):
    results = run_on_ranks(_schedules, 2, str(tmp_path), timeout=180)

    def every_rank(name):  # the V holds other layers on each rank: compare the whole model
        return {k: v for runs, _, _ in results for k, v in runs[name][1].items()}

    for rank, (runs, chunks, loaded) in enumerate(results):
        _assert_same_run(runs["zb-h1"], runs["1f1b"], "zb-h1", runs["zb-h1"][1],
                         runs["1f1b"][1])
        _assert_same_run(runs["zbv"], runs["1f1b untied"], "zbv", every_rank("zbv"),
                         every_rank("1f1b untied"))
        # the V of 4 chunks: rank 0 holds chunks 0 and 3 (embedding .. , .. head)
        assert chunks == ([[0, 1], [4, 5, 6, 7]] if rank == 0 else [[2], [3]]), chunks
        # the zbv save loaded at 1f1b pp2 takes the step zbv itself took next
        torch.testing.assert_close(loaded, runs["zbv"][3], rtol=RTOL, atol=ATOL)


def test_zbv_refuses_a_tied_module_on_its_first_and_last_stage():
    from gigatron.engine.pipe.split_backward import check_v_ties

    check_v_ties("zbv", {"embed": [0]})
    check_v_ties("zb-h1", {"embed": [0, 3]})
    with pytest.raises(ValueError) as err:
        check_v_ties("zbv", {"embed": [0, 3]})
    assert "TiedLayerSpec 'embed'" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": "zbv", "virtual_stages": 3}, "zbv places exactly 2 chunks per stage in a V "
                                               "(got 3 from virtual_stages=3)"),
    ({"schedule": "gpipe"}, "PipelineModule(schedule='gpipe'): choose one of 1f1b, zb-h1, zbv"),
    ({"schedule": "zb-h1", "virtual_stages": 2}, "zb-h1 runs one chunk per stage (got 2 from "
                                                 "virtual_stages=2): drop virtual_stages=2"),
])
def test_bad_schedules_get_one_line_naming_the_argument(kwargs, message):
    from gigatron.engine.pipe.split_backward import check_schedule

    with pytest.raises(ValueError) as err:
        check_schedule(kwargs["schedule"], kwargs.get("virtual_stages", 1))
    assert message in str(err.value) and "\n" not in str(err.value)
