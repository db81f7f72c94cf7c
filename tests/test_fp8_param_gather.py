"""--fp8-param-gather (parallel/zero/fp8_gather.py): ZeRO 1-2 quantise their shards of the
updated weights and all-gather the FP8 linears' weights as FP8 bytes; the linears use the
gathered weight as it is. At dp2 the run equals the run without it at the same recipe
(the quantised weights are the same bytes), and the all-gather carries one byte per FP8
weight element instead of bf16's two."""
import pytest
import torch

from multirank import run_on_ranks

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel.tensor.fp8 import FP8Recipe
from gigatron.parallel.tensor.fp8 import _forward_operands
from gigatron.parallel.zero.fp8_gather import FP8ParamGather
from gigatron.training.run.builders import (apply_fp8, fp8_amax_group, fp8_param_states,
                                            transformer_linears)

SCALINGS = ("tensorwise", "delayed", "blockwise")


def _config(hidden=32, ffn=None):
    return TransformerConfig(num_layers=2, hidden_size=hidden, num_attention_heads=2,
                             ffn_hidden_size=ffn or 4 * hidden, vocab_size=64,
                             make_vocab_size_divisible_by=16, seq_length=16, hidden_dropout=0.0,
                             attention_dropout=0.0, add_bias_linear=False,
                             params_dtype=torch.bfloat16)


def _batches(steps, batch, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = (torch.randint(0, 64, (batch, 1), generator=g) + torch.arange(17)) % 64
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _zero(model, config, groups=None, gather=True, own_buffers=True):
    """ZeRO around `model` (FP8 on); with `gather`, as --fp8-param-gather builds it
    (`own_buffers=False`: the FP8 weights share flat buffers with the other parameters)."""
    from gigatron.parallel.zero import build_zero
    from gigatron.parallel.zero.param_groups import FP8_PARAM_ATTR

    states = fp8_param_states([model]) if gather else None
    if not own_buffers:
        for p in model.parameters():
            p.__dict__.pop(FP8_PARAM_ATTR, None)
    zero = build_zero(model, config, groups)
    if states is not None:
        zero.fp8_param_gather = FP8ParamGather(zero.flat_groups, states)
    return zero


def _fp8_weights(model):
    """Each FP8 linear's weight as its next forward multiplies it: FP8 bytes, factors."""
    out = []
    for layer in transformer_linears(model):
        w = _forward_operands(torch.zeros(1, layer.weight.shape[1], dtype=torch.bfloat16),
                              layer.weight, layer.fp8)[1]
        out.append((w.data.view(torch.uint8).clone(), w.scale_inv.clone()))
    return out


def _train(rank, world, scaling, gather, stage, steps, config, own_buffers=True):
    """`steps` ZeRO steps of a 2-layer bf16 GPT in FP8 at dp=world (each rank its half of
    every batch): losses, the FP8 weights of the next forward, the other parameters, what
    each all-gather carried."""
    from gigatron.parallel import comm
    from gigatron.parallel.topology import ProcessGroups, Topology
    from gigatron.parallel.zero import ZeroConfig

    groups = ProcessGroups(Topology(dp=world), rank)
    model = GPTModel(config, seed=7)
    recipe = FP8Recipe("hybrid", amax_history_len=4, amax_compute_algo="max", scaling=scaling)
    apply_fp8([model], recipe, fp8_amax_group(groups, scaling))
    zero = _zero(model, ZeroConfig(zero_stage=stage, lr=1e-2, weight_decay=0.0,
                                   reduce_bucket_size=5000), groups, gather, own_buffers)
    gathered, real = [], comm.all_gather

    def counting(output, input, group=None, async_op=False):
        gathered.append((input.dtype, output.numel() * output.element_size()))
        return real(output, input, group, async_op)

    comm.all_gather = counting
    losses = []
    try:
        for tokens, labels in _batches(steps, 4 * world):
            zero.zero_grad()
            mine = slice(4 * rank, 4 * rank + 4)
            loss = model(input_ids=tokens[mine], labels=labels[mine]).float().mean()
            zero.backward(loss)
            zero.step()
            losses.append(loss.item())
    finally:
        comm.all_gather = real
    published = [layer.fp8.param_fp8 for layer in transformer_linears(model)]
    dtypes = {p.operand.data.dtype for p in published if p is not None}
    fp8 = {id(layer.weight) for layer in transformer_linears(model)}
    others = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in fp8}
    fp8_numel = sum(layer.weight.numel() for layer in transformer_linears(model))
    return (losses, _fp8_weights(model), others, gathered, dtypes, fp8_numel,
            sum(p.numel() for p in model.parameters()))


def _without_and_with(rank, world, *args):
    return [_train(rank, world, args[0], gather, *args[1:]) for gather in (False, True)]


def _both(scaling, stage, steps=4, config=None, own_buffers=True):
    """Per rank: the run without the flag, the run with it (one launch)."""
    per_rank = run_on_ranks(_without_and_with, 2, scaling, stage, steps, config or _config(),
                            own_buffers)
    return [[runs[0] for runs in per_rank], [runs[1] for runs in per_rank]]


@pytest.mark.parametrize("scaling,stage,own_buffers", [
    ("tensorwise", 1, True), ("delayed", 2, True), ("blockwise", 1, True),
    ("tensorwise", 2, False)])
def test_dp2_fp8_param_gather_equals_the_run_without_it(scaling, stage, own_buffers):
    """Tolerance: none. Each rank quantises its shard with the whole weight's scale (amax
    MAX-reduced over dp, per tile for blockwise: the bucket shards cut weights and tiles
    anywhere), so the gathered FP8 bytes are the ones the forward would have made from the
    bf16 weight: losses, every FP8 weight (bytes, factors) and the other parameters equal
    bit for bit over 4 steps (a shard quantised with its own amax fails tensorwise and
    blockwise). Also where the FP8 weights share flat buffers with other parameters
    (slices mixing FP8 bytes and bf16 values)."""
    # blockwise: weights of 2 x 2 to 3 x 2 tiles of 128 x 128
    without, with_gather = _both(scaling, stage, config=_config(160, 256)
                                 if scaling == "blockwise" else None,
                                 own_buffers=own_buffers)
    for a, b in zip(without, with_gather):
        assert a[0] == b[0], (a[0], b[0])
        for (bytes_a, factors_a), (bytes_b, factors_b) in zip(a[1], b[1]):
            assert torch.equal(bytes_a, bytes_b) and torch.equal(factors_a, factors_b)
        for name, value in a[2].items():
            assert torch.equal(value, b[2][name]), name
        assert a[4] == set() and b[4] == {torch.float8_e4m3fn}


def test_the_fp8_weights_are_gathered_in_one_byte_per_element():
    """Bytes all-gathered per step at dp2 (ZeRO 1, one bucket per ~5000 elements): without
    the flag every parameter goes in bf16 (2 bytes); with it the FP8 linears' weights go as
    uint8 views of float8 buffers, one byte each (within the padding of the per-rank slices,
    measured +0%), and the rest stays bf16: the FP8 weights cost half of bf16's."""
    steps = 2
    without, with_gather = _both("tensorwise", 1, steps)
    for a, b in zip(without, with_gather):
        fp8_numel, numel = b[5], b[6]
        assert {d for d, _ in a[3]} == {torch.bfloat16}
        plain = sum(n for _, n in a[3]) / steps
        assert plain >= 2 * numel
        fp8 = sum(n for d, n in b[3] if d == torch.uint8) / steps
        rest = sum(n for d, n in b[3] if d == torch.bfloat16) / steps
        print(dict(fp8_numel=fp8_numel, numel=numel, plain=plain, fp8=fp8, rest=rest))
        assert fp8_numel <= fp8 <= 1.01 * fp8_numel
        assert rest <= plain - 2 * fp8_numel + 64  # the other parameters, as before
        assert fp8 + rest <= plain - 0.99 * fp8_numel


def test_the_forward_uses_the_gathered_fp8_weight_without_quantising_again():
    """After a step the FP8 linears run on the published FP8 bytes: overwriting the
    parameters' bf16 storage does not change the output (without the flag it does)."""
    from gigatron.parallel.zero import ZeroConfig

    tokens, labels = _batches(1, 2)[0]
    outputs = []
    for gather in (False, True):
        model = GPTModel(_config(), seed=7)
        apply_fp8([model], FP8Recipe(scaling="tensorwise"), None)
        zero = _zero(model, ZeroConfig(zero_stage=1, lr=1e-2), gather=gather)
        zero.zero_grad()
        zero.backward(model(input_ids=tokens, labels=labels).float().mean())
        zero.step()
        with torch.no_grad():
            before = model(input_ids=tokens, labels=labels)
            for layer in transformer_linears(model):
                layer.weight.mul_(3.0)
            outputs.append(torch.equal(before, model(input_ids=tokens, labels=labels)))
    assert outputs == [False, True]


def test_zero_stage_3_is_refused_with_the_fix():
    from gigatron.parallel.zero import ZeroConfig

    model = GPTModel(_config(), seed=7)
    apply_fp8([model], FP8Recipe(scaling="tensorwise"), None)
    with pytest.raises(ValueError, match="--fp8-param-gather is built for ZeRO stages 1 and 2"):
        _zero(model, ZeroConfig(zero_stage=3, lr=1e-2))


FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 64 "
         "--fp8-format hybrid --fp8-param-gather").split()


def test_the_flag_refuses_zero_stage_3_and_the_banner_says_what_runs():
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.features import flag_notes
    from gigatron.training.config.validation import ConfigError

    with pytest.raises(ConfigError, match="--fp8-param-gather is not built for --zero-stage 3"):
        parse_args(FLAGS + ["--zero-stage", "3"], 1)
    run = parse_args(FLAGS + "--use-distributed-optimizer --overlap-grad-reduce "
                             "--overlap-param-gather".split(), 1)
    notes = "\n".join(flag_notes(run.settings, "gloo"))
    assert "all-gathers the FP8 linears' weights in FP8" in notes
    assert "gathered right after the step, not under the next forward" in notes
