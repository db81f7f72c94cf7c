"""gigatron.pipe's PipelineModule under the zero-bubble schedule (issue 29): a user's own
transformer (tests/pipe_user_model.py: tied embeddings, nn.Linear blocks) built with
`PipelineModule(..., schedule="zb-h1")` and trained through gigatron.initialize and
train_batch at pp2 equals the same model under 1F1B at pp2 step by step (losses and every
final parameter within 1e-5, fp32, AdamW), on forked gloo ranks. The split is real: under
zb-h1 the Linears' weight gradients are deferred to W (counted), under 1F1B none are.
Bad schedules get one line naming the argument.
"""
import pytest
import torch

import pipe_user_model as um
from multirank import run_on_ranks
from test_pipeline_user_model import ATOL, GLOBAL_MICRO, RTOL, STEPS, config


def _train(net):
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
    return losses, {k: v.detach().clone() for k, v in net.state_dict().items()}, deferred[0]


def _both_schedules(rank, world):
    """(1f1b run, zb-h1 run) of the same model at pp2."""
    from gigatron.pipe import PipelineModule

    return [_train(PipelineModule(um.layers(), num_stages=world, loss_fn=um.loss_fn,
                                  seed_layers=True, schedule=schedule))
            for schedule in ("1f1b", "zb-h1")]


def test_zb_h1_at_pp2_trains_as_1f1b():
    for (losses, params, none), (zb_losses, zb_params, deferred) in run_on_ranks(
            _both_schedules, 2, timeout=180):
        torch.testing.assert_close(torch.tensor(zb_losses), torch.tensor(losses), rtol=RTOL,
                                   atol=ATOL)
        assert losses[0] != losses[-1]  # it trained
        assert set(zb_params) == set(params)
        for name, value in params.items():
            torch.testing.assert_close(zb_params[name], value, rtol=RTOL, atol=ATOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        # 2 blocks per stage x 4 Linears x 8 micro-batches x 3 steps deferred to W
        assert none == 0 and deferred == 2 * 4 * GLOBAL_MICRO * STEPS, (none, deferred)


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": "zbv"}, "PipelineModule(schedule='zbv') is not supported"),
    ({"schedule": "gpipe"}, "PipelineModule(schedule='gpipe'): choose one of 1f1b, zb-h1"),
    ({"schedule": "zb-h1", "virtual_stages": 2}, "drop virtual_stages=2"),
])
def test_bad_schedules_get_one_line_naming_the_argument(kwargs, message):
    from gigatron.engine.pipe.split_backward import check_schedule

    with pytest.raises(ValueError) as err:
        check_schedule(kwargs["schedule"], kwargs.get("virtual_stages", 1))
    assert message in str(err.value) and "\n" not in str(err.value)
