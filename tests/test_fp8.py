"""FP8 in the tensor-parallel linears (Megatron's --fp8-format; here Transformer Engine's
delayed scaling, the GEMMs through torch._scaled_mm): rounding and scale arithmetic against
values computed by hand, the amax history, the GEMM's forward and backward against the
formula, which layers run in FP8, a GPT trained in FP8 against bf16, and tp=2 against tp=1."""
import dataclasses
import math

import pytest
import torch

from multirank import run_on_ranks

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.parallel.tensor import ColumnParallelLinear, RowParallelLinear, gather_full_parameter
from gigatron.parallel.tensor.fp8 import (E4M3, E5M2, FP8Recipe, ScalingMeta, enable_fp8,
                                          fake_quantize, fp8_linear, scale_from_amax)
from gigatron.training.run.builders import apply_fp8, transformer_linears

ONE = torch.tensor(1.0)


def test_e4m3_and_e5m2_round_to_nearest_even_and_saturate():
    # E4M3: 3 mantissa bits (steps of 1/8 in [1, 2)), max 448, subnormal step 2**-9;
    # E5M2: 2 mantissa bits (steps of 1/4), max 57344
    x = torch.tensor([0.3, 500.0, 1.1, 1.0625, 1.1875, 0.003, -0.3, 1e6])
    assert fake_quantize(x, ONE, E4M3).tolist() == [
        0.3125, 448.0, 1.125, 1.0, 1.25, 2 * 2 ** -9, -0.3125, 448.0]
    assert fake_quantize(x, ONE, E5M2).tolist() == [
        0.3125, 512.0, 1.0, 1.0, 1.25, 1.5 * 2 ** -9, -0.3125, 57344.0]
    # scale 2: 0.3 -> 0.6 -> 0.625 (1.25 x 2**-1) -> back to 0.3125; 500 -> 1000 -> 448 -> 224
    assert fake_quantize(torch.tensor([0.3, 500.0]), torch.tensor(2.0), E4M3).tolist() == \
        [0.3125, 224.0]


def test_scale_is_fp8_max_over_amax_over_two_to_the_margin_and_kept_when_amax_is_useless():
    amax = torch.tensor([2.0, 0.0, math.inf, math.nan, 1e-45])
    old = torch.full((5,), 5.0)
    assert scale_from_amax(amax, old, 448.0, 0).tolist() == \
        [224.0, 5.0, 5.0, 5.0, torch.finfo(torch.float32).max]
    assert scale_from_amax(torch.tensor([2.0]), torch.ones(1), 57344.0, 2).tolist() == [7168.0]


@pytest.mark.parametrize("algo,scales", [
    # amaxes 4, 2, 8, 1 (one per step); history 3 rows: row 0 the current step
    ("max", [112.0, 112.0, 56.0, 56.0]),       # 448 / max of the last 3 steps
    ("most_recent", [112.0, 224.0, 56.0, 448.0])])  # 448 / this step's
def test_amax_history_window(algo, scales):
    meta = ScalingMeta(1, E4M3, FP8Recipe(amax_history_len=3, amax_compute_algo=algo))
    got = []
    for a in (4.0, 2.0, 8.0, 1.0):
        meta.quantize(0, torch.tensor([a, -a / 2]))
        assert meta.amax_history[0, 0] == a
        meta.update()
        assert meta.amax_history[0, 0] == 0  # a fresh current row
        got.append(meta.scale.item())
    assert got == scales
    # the ring keeps the last two steps behind the current row
    assert sorted(meta.amax_history[1:, 0].tolist()) == [1.0, 8.0]


def test_fp8_linear_forward_and_backward_are_the_formula_with_delayed_scales():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 8, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    for wgrad in (True, False):
        region = enable_fp8(layer, [layer], FP8Recipe("hybrid", wgrad=wgrad))
        state = layer.fp8
        state.forward.scale.copy_(torch.tensor([3.0, 5.0]))
        state.backward.scale.copy_(torch.tensor([7.0]))
        x = torch.randn(4, 3, 16, requires_grad=True)
        g = torch.randn(4, 3, 8)
        y = layer(x)
        y.backward(g)
        xq, wq = fake_quantize(x, torch.tensor(3.0), E4M3), fake_quantize(
            layer.weight, torch.tensor(5.0), E4M3)
        gq = fake_quantize(g, torch.tensor(7.0), E5M2)
        torch.testing.assert_close(y, xq @ wq.t() + layer.bias, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(x.grad, gq @ wq, rtol=1e-6, atol=1e-5)
        wgrad_want = (gq.reshape(-1, 8).t() @ xq.reshape(-1, 16)) if wgrad else \
            (g.reshape(-1, 8).t() @ x.detach().reshape(-1, 16))
        torch.testing.assert_close(layer.weight.grad, wgrad_want, rtol=1e-6, atol=1e-4)
        # after the forward and the backward: the next scales come from this step's amaxes
        assert state.forward.scale.tolist() == pytest.approx(
            [448.0 / x.abs().max().item(), 448.0 / layer.weight.abs().max().item()])
        assert state.backward.scale.item() == pytest.approx(57344.0 / g.abs().max().item())
        layer.weight.grad = None
        for h in region.handles:
            h.remove()


def test_the_non_fp8_path_is_plain_f_linear():
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(8, 4), RowParallelLinear(4, 8)
    for layer in (col, row):
        for p in layer.parameters():
            torch.nn.init.normal_(p)
    x = torch.randn(3, 8)
    assert col.fp8 is None and row.fp8 is None
    assert torch.equal(col(x), torch.nn.functional.linear(x, col.weight, col.bias))
    assert torch.equal(row(x[:, :4]), torch.nn.functional.linear(x[:, :4], row.weight) +
                       row.bias)
    assert torch.equal(fp8_linear(x, col.weight, None, _identity_state()),
                       torch.nn.functional.linear(
                           fake_quantize(x, ONE, E4M3), fake_quantize(col.weight, ONE, E4M3)))


def _identity_state():
    from gigatron.parallel.tensor.fp8 import FP8LinearState
    return FP8LinearState(FP8Recipe())


def gpt_config(dtype=torch.float32, num_layers=2):
    return TransformerConfig(num_layers=num_layers, hidden_size=32, num_attention_heads=4,
                             vocab_size=64, make_vocab_size_divisible_by=16, seq_length=16,
                             hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False,
                             params_dtype=dtype)


def test_only_the_transformer_layers_linears_run_in_fp8():
    model = GPTModel(gpt_config())
    apply_fp8([model], FP8Recipe(), None)
    fp8 = {name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    assert fp8 == {f"decoder.layers.{i}.{part}" for i in range(2) for part in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
        "mlp.linear_fc2")}
    assert model.output_layer.fp8 is None
    assert len(transformer_linears(model)) == 8


def _batches(steps, batch=8, seed=3):
    """A learnable stream: each sample counts up from a random start (mod 64)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = (torch.randint(0, 64, (batch, 1), generator=g) + torch.arange(17)) % 64
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _train(fp8, steps=25, dtype=torch.bfloat16):
    model = GPTModel(gpt_config(dtype), seed=7)
    if fp8:
        apply_fp8([model], FP8Recipe("hybrid", amax_history_len=8, amax_compute_algo="max"),
                  None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for tokens, labels in _batches(steps):
        opt.zero_grad()
        loss = model(input_ids=tokens, labels=labels).float().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_gpt_trains_in_fp8_close_to_bf16():
    """Tolerance: E4M3 keeps 4 significant bits, a relative rounding error of at most 2**-4
    per operand (E5M2: 2**-3 for output-gradients); each GEMM output averages many such
    independent errors, so a step's loss moves by well under 1%, and over 25 AdamW steps the
    two curves stay within 2% of each other (measured: 0.7% at most), while both fall by
    more than half; yet they differ (by more than 1e-4 somewhere): the rounding happened."""
    bf16, fp8 = _train(False), _train(True)
    assert fp8[-1] < 0.5 * fp8[0] and bf16[-1] < 0.5 * bf16[0]
    assert fp8[0] == pytest.approx(bf16[0], rel=0.01)  # step 1: scale 1, nothing saturates
    for i, (a, b) in enumerate(zip(fp8, bf16)):
        assert a == pytest.approx(b, rel=0.02), f"step {i + 1}: fp8 {a:.4f} bf16 {b:.4f}"
    assert max(abs(a - b) / b for a, b in zip(fp8, bf16)) > 1e-4


def _tp_run(rank, world, steps):
    from gigatron.parallel.topology import ProcessGroups, Topology
    tp = world
    groups = ProcessGroups(Topology(tp=tp), rank) if tp > 1 else None
    tp_group = groups.tp if groups else None
    model = GPTModel(gpt_config(), tp_group=tp_group, seed=7)
    apply_fp8([model], FP8Recipe("hybrid", amax_history_len=4, amax_compute_algo="max"),
              tp_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for tokens, labels in _batches(steps, batch=4):
        opt.zero_grad()
        loss = model(input_ids=tokens, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    scales = [m.fp8.forward.scale.tolist() + m.fp8.backward.scale.tolist()
              for m in transformer_linears(model)]
    params = {n: gather_full_parameter(p, tp_group) for n, p in model.named_parameters()}
    return losses, scales, params


def test_tp2_equals_tp1_under_delayed_fp8():
    """The amaxes are MAX-reduced over tp, so both layouts quantise with the same scales
    (asserted equal up to float noise) and the same FP8 operands; what remains is the GEMMs'
    summation order (tp splits the reductions of the row-parallel layers), which can move a
    value across an FP8 rounding boundary now and then. Tolerance: losses within 1e-6
    relative, parameters after 4 SGD steps within 1e-5 relative (L2), scales within 1e-5
    (measured: 1.2e-7 and 2.7e-7; without the amax reduction over tp the parameters differ
    by 10%)."""
    one = _tp_run(0, 1, 4)
    two = run_on_ranks(_tp_run, 2, 4)
    for losses, scales, params in two:
        assert losses == pytest.approx(one[0], rel=1e-6)
        for a, b in zip(scales, one[1]):
            assert a == pytest.approx(b, rel=1e-5)
        for name, want in one[2].items():
            err = ((params[name] - want).norm() / want.norm()).item()
            assert err <= 1e-5, f"{name}: {err:.3g}"
    assert one[1][0] != [1.0, 1.0, 1.0]  # the scales did move off their start


FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 64").split()


def test_flags_map_to_the_recipe_and_refuse_what_is_not_supported():
    from gigatron.training.config.arguments import parse_args
    from gigatron.training.config.megatron.fp8 import fp8_recipe
    from gigatron.training.config.validation import ConfigError

    run = parse_args(FLAGS + "--fp8-format e4m3 --fp8-margin 1 --fp8-amax-history-len 16 "
                             "--fp8-amax-compute-algo max --disable-fp8-wgrad".split(), 1)
    assert fp8_recipe(run.settings.fp8) == FP8Recipe("e4m3", 1, 16, "max", wgrad=False)
    assert fp8_recipe(parse_args(FLAGS, 1).settings.fp8) is None
    defaults = fp8_recipe(parse_args(FLAGS + ["--fp8-format", "hybrid"], 1).settings.fp8)
    assert defaults == FP8Recipe("hybrid", 0, 1, "most_recent", wgrad=True)  # Megatron's
    for scaling in ("tensorwise", "blockwise"):  # --no-fp8-wgrad is delayed scaling's only
        run = parse_args(FLAGS + f"--fp8-format hybrid --fp8-recipe {scaling} "
                                 "--no-fp8-wgrad".split(), 1)
        assert fp8_recipe(run.settings.fp8) == FP8Recipe("hybrid", scaling=scaling)
    with pytest.raises(ConfigError) as err:
        parse_args(FLAGS + "--fp8-format hybrid --fp8-recipe mxfp8 --recompute-activations "
                           "--fp8-param-gather".split(), 1)
    assert "recomputation" not in str(err.value)  # replayed with the forward's scales
    for message in ("--fp8-recipe mxfp8 is not supported",
                    "--fp8-param-gather needs the distributed optimizer"):
        assert message in str(err.value)
    with pytest.raises(ConfigError, match="--fp8-param-gather needs --fp8-format"):
        parse_args(FLAGS + ["--fp8-param-gather", "--use-distributed-optimizer"], 1)


def _fp8_steps(recompute, steps=3):
    """Losses, gradients and the first layer's amax history of `steps` fp32 steps in FP8."""
    config = gpt_config()
    if recompute:
        config = dataclasses.replace(config, recompute_granularity="full",
                                     recompute_method="uniform", recompute_num_layers=1)
    model = GPTModel(config, seed=7)
    apply_fp8([model], FP8Recipe("hybrid", amax_history_len=4, amax_compute_algo="max"), None)
    out = []
    for tokens, labels in _batches(steps):
        model.zero_grad()
        loss = model(input_ids=tokens, labels=labels).float().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.05 * p.grad
        fc1 = model.decoder.layers["0"].mlp.linear_fc1.fp8
        out.append((loss.item(), [p.grad.clone() for p in model.parameters()],
                    fc1.forward.amax_history.clone(), fc1.forward.scale.clone()))
    return out


def test_full_recomputation_in_fp8_replays_the_forwards_scales():
    """A recomputed layer quantises with the scales of its original forward and records no
    amax (as TE): losses, gradients and FP8 state equal a run that keeps activations
    (without the replay, step 1's recomputation used the scales updated after the forward)."""
    kept, recomputed = _fp8_steps(False), _fp8_steps(True)
    for step, (a, b) in enumerate(zip(kept, recomputed)):
        assert a[0] == b[0], step
        for g, h in zip(a[1], b[1]):
            torch.testing.assert_close(g, h, rtol=0, atol=0)
        assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3]), step
