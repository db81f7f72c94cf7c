"""gigatron.pipe's partitioning as pure functions (DeepSpeed's partition methods), the stage
boundary a message crosses, the payload specs of the shape handshake, and the one-line
errors of bad PipelineModule input."""
import itertools

import pytest
import torch
from torch import nn

from gigatron.engine.pipe.partition_method import (describe_partition, partition_balanced,
                                                        partition_by_method, partition_uniform,
                                                        stage_of_layer, tied_stages)
from gigatron.parallel.pipeline.schedules import (COMMUNICATION, RecvActivation, RecvGrad,
                                                  SendActivation, SendGrad, build_schedule,
                                                  message_boundary, peer)
from gigatron.parallel.pipeline.shaped_p2p import PayloadSpec


def _valid(parts, n, m):
    assert len(parts) == m + 1 and parts[0] == 0 and parts[-1] == n
    assert all(a < b for a, b in zip(parts, parts[1:])), parts  # no empty stage


def _weights(parts, weights):
    return [sum(weights[a:b]) for a, b in zip(parts, parts[1:])]


def test_uniform_gives_the_first_stages_one_more_layer():
    for n in range(1, 40):
        for m in range(1, n + 1):
            parts = partition_uniform(n, m)
            _valid(parts, n, m)
            sizes = [b - a for a, b in zip(parts, parts[1:])]
            assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    assert partition_uniform(2, 4) == [0, 1, 2, 2, 2]  # DeepSpeed's, refused by the module


def test_balanced_gives_deepspeeds_partitions():
    # the expectations of DeepSpeed's own unit tests (tests/unit/runtime/utils/test_partition.py)
    assert partition_balanced([0, 1, 2, 3, 3, 3], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([0., 1.1, 1.9, 3., 3., 3.], 4) == [0, 3, 4, 5, 6]
    assert partition_balanced([0., 1.1, 30, 3.], 3) == [0, 2, 3, 4]
    assert _weights(partition_balanced([1] * 8, 4), [1] * 8) == [2, 2, 2, 2]
    bert = [52559872] + [12596224] * 24 + [0, 52559872]
    assert partition_balanced(bert, 8) == [0, 1, 5, 9, 13, 17, 21, 26, 27]


def test_balanced_on_every_small_input():
    """Every weight list over {0, 1, 2, 5} up to 6 layers, every stage count: a valid
    partition; for 2 stages the smallest spread, the latest cut on a tie (DeepSpeed's)."""
    for n in range(1, 7):
        for weights in itertools.product((0, 1, 2, 5), repeat=n):
            for m in range(1, n + 1):
                parts = partition_balanced(list(weights), m)
                _valid(parts, n, m)
            if n >= 2:
                spreads = [abs(sum(weights[:k]) - sum(weights[k:])) for k in range(1, n)]
                best = max(k for k in range(1, n) if spreads[k - 1] == min(spreads))
                assert partition_balanced(list(weights), 2) == [0, best, n], weights


def test_methods_and_their_errors():
    counts, names = [100, 10, 10, 10, 10, 0, 100], ["Embed"] + ["Block"] * 4 + [None, "Head"]
    assert partition_by_method("uniform", counts, names, 2) == [0, 4, 7]
    assert partition_by_method("parameters", counts, names, 2) == [0, 3, 7]
    assert partition_by_method("type:block", counts, names, 2) == [0, 3, 7]  # case-insensitive
    assert partition_by_method("type:^(embed|head)$", counts, names, 2) == [0, 6, 7]
    for method, words in [("profile", "not one of"), ("type:Nothing", "matches no layer"),
                          ("type:(", "not a valid regular expression")]:
        with pytest.raises(ValueError, match=words) as err:
            partition_by_method(method, counts, names, 2)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="7 layers cannot fill 8 pipeline stages") as err:
        partition_by_method("uniform", counts, names, 8)
    assert "\n" not in str(err.value)


def test_tied_layers_live_on_one_stage_or_on_the_first_and_last():
    parts = [0, 2, 4, 6]
    assert tied_stages(["e", None, None, None, None, "e"], parts) == {"e": [0, 2]}
    assert tied_stages(["e", "e", None, None, None, None], parts) == {"e": [0]}
    with pytest.raises(ValueError, match="lands on virtual stages \\[0, 1\\]"):
        tied_stages(["e", None, "e", None, None, None], parts)
    assert [stage_of_layer(parts, i) for i in range(6)] == [0, 0, 1, 1, 2, 2]


def test_the_partition_printout_names_stages_layers_and_parameters():
    text = describe_partition([0, 1, 3, 4, 5], ["Embed", "Block", "Block", "Block", "Head"],
                              [10, 20, 20, 20, 10], 2)
    assert text.splitlines()[0] == "stage 0 (pipeline stage 0, chunk 0): layers 0-0, 10 parameters"
    assert "stage 3 (pipeline stage 1, chunk 1): layers 4-4, 10 parameters" in text
    assert "      2: Block (20)" in text


def test_both_ends_of_every_message_name_the_same_boundary():
    for pp, v, m in itertools.product((2, 3, 4), (1, 2, 3), (12, 24)):
        for rank in range(pp):
            for op in build_schedule(rank, pp, m, v):
                if not isinstance(op, COMMUNICATION):
                    continue
                other, chunk = peer(op, rank, pp)
                mirror = {SendActivation: RecvActivation, RecvActivation: SendActivation,
                          SendGrad: RecvGrad, RecvGrad: SendGrad}[type(op)]
                here = message_boundary(op, rank, pp)
                assert here == message_boundary(mirror(op.microbatch, chunk), other, pp)
                assert 0 <= here < pp * v - 1


def test_payload_specs_round_trip_and_give_the_grads_spec():
    payload = (torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64), torch.zeros(4).half())
    spec = PayloadSpec.of(payload)
    assert PayloadSpec.decode(spec.encode(torch.device("cpu"))) == spec
    assert spec.grad_spec().shapes == ((2, 3), (4,)) and spec.grad_spec().is_tuple
    single = PayloadSpec.of(torch.zeros(5, 1))
    assert not single.is_tuple and isinstance(single.empty(torch.device("cpu")), torch.Tensor)
    with pytest.raises(ValueError, match="tensor or a non-empty tuple of tensors"):
        PayloadSpec.of((torch.zeros(1), 3))


def test_bad_layers_are_one_clear_line():
    from gigatron.pipe import LayerSpec, PipelineModule

    cases = [
        (lambda: PipelineModule([nn.Linear(2, 2), "relu"], num_stages=1),
         "layers\\[1\\] is a str .* neither an nn.Module, a LayerSpec"),
        (lambda: LayerSpec(torch.relu), "LayerSpec needs an nn.Module class"),
        (lambda: PipelineModule([nn.Linear(2, 2)]), "needs num_stages=N or topology="),
        (lambda: PipelineModule([nn.Linear(2, 2)], num_stages=2),
         "num_stages=2\\) must divide the world size 1"),
        (lambda: PipelineModule([nn.Linear(2, 2)], num_stages=1, virtual_stages=2),
         "needs num_stages > 1"),
        (lambda: PipelineModule([nn.Linear(2, 2)], num_stages=1, partition_method="best"),
         "partition_method='best' is not one of"),
    ]
    for build, words in cases:
        with pytest.raises((ValueError, TypeError), match=words) as err:
            build()
        assert "\n" not in str(err.value), str(err.value)


def _refusals(rank, world):
    """The errors that need two ranks (two stages), each as its message."""
    import gigatron
    from gigatron.pipe import LayerSpec, PipelineModule

    def message(build):
        try:
            build()
        except ValueError as err:
            return str(err)
        return None

    def engine(zero, accumulation):
        net = PipelineModule([LayerSpec(nn.Linear, 2, 2) for _ in range(4)], num_stages=2,
                             virtual_stages=2, loss_fn=lambda out, labels: out.sum())
        gigatron.initialize(model=net, config={
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": zero}})

    return [message(lambda: PipelineModule([LayerSpec(nn.Linear, 2, 2)], num_stages=2)),
            message(lambda: engine(3, 2)), message(lambda: engine(1, 3))]


def test_errors_on_two_stages_are_one_clear_line():
    from multirank import run_on_ranks

    for messages in run_on_ranks(_refusals, 2):
        assert all(m is not None and "\n" not in m for m in messages), messages
        stages, zero3, accumulation = messages
        assert stages.startswith("1 layer cannot fill 2 pipeline stages")
        assert zero3.startswith("zero_optimization.stage 3 needs a PipelineModule's num_stages 1, "
                                 "got 2")
        assert "needs gradient_accumulation_steps (3) to be a multiple of num_stages" in accumulation
