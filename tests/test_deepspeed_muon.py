"""DeepSpeed's `"optimizer": {"type": "Muon"}` in gigatron.initialize, piece by piece against the
installed DeepSpeed's own functions (in this process; the whole engine on 2 ranks at ZeRO 0-3
is tests/test_deepspeed_parity.py's test_gigatron_muon_matches_deepspeed_muon).

DeepSpeed torch.compiles its Newton-Schulz and muon_update; they run eagerly here (dynamo
disabled inside the tests): the same operations without a C++ compiler run.
"""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from gigatron.engine.deepspeed.muon import muon_param_groups, tag_use_muon
from gigatron.parallel.zero.muon import Muon
from gigatron.parallel.zero.muon.deepspeed import newton_schulz
from gigatron.training.config.deepspeed.engine import engine_config
from gigatron.training.config.validation import ConfigError

deepspeed = pytest.importorskip("deepspeed", reason="the real DeepSpeed is not installed: "
                                "DS_BUILD_OPS=0 pip install deepspeed==0.19.8")
from deepspeed.runtime.zero.muon import original_muon  # noqa: E402
from deepspeed.runtime.engine import DeepSpeedEngine  # noqa: E402

SHAPES = [(32, 8), (8, 32), (16, 16), (4, 32), (3, 6, 10)]


def eager():
    from torch._dynamo import config

    return config.patch(disable=True)


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", SHAPES)
def test_newton_schulz_equals_deepspeeds(method, shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    with eager():
        theirs = (original_muon.zeropower_via_gram_newtonschulz(g, 5) if method == "gram"
                  else original_muon.zeropower_via_newtonschulz5(g, 5))
    ours = newton_schulz(g, method)
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method", ["gram", "standard"])
@pytest.mark.parametrize("shape", SHAPES)
def test_three_updates_equal_deepspeeds_muon_update(method, shape):
    """Momentum (EMA), nesterov, orthogonalisation and sqrt(max(1, rows/cols)), step after
    step; a 3-D tensor is a batch of matrices, each on its own (DeepSpeed's batched path)."""
    g = torch.Generator().manual_seed(3)
    p = nn.Parameter(torch.randn(shape, generator=g))
    muon = Muon([{"params": [p], "use_muon": True, "momentum": 0.9}], ns_method=method,
                lr=0.1)
    momentum = torch.zeros(shape)
    for _ in range(3):
        grad = torch.randn(shape, generator=g)
        with eager():
            theirs = original_muon.muon_update(grad.clone(), momentum, beta=0.9,
                                               ns_method=method)
        ours = muon.update_of(p, grad)
        torch.testing.assert_close(ours, theirs.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(muon.state[p]["momentum_buffer"], momentum)


def test_a_conv_filter_is_orthogonalised_as_out_by_rest():
    """What DeepSpeed's muon_update means for 4-D tensors (0.19.8 fails on them): [out, rest],
    scaled by sqrt(max(1, kh / kw)) of the last two dimensions (1 here)."""
    p = nn.Parameter(torch.randn(4, 2, 3, 3))
    grad = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(1))
    muon = Muon([{"params": [p], "use_muon": True, "momentum": 0.9}], ns_method="gram")
    nesterov = grad.lerp(0.1 * grad, 0.9)  # the momentum after one step is (1 - beta) grad
    torch.testing.assert_close(muon.update_of(p, grad),
                               newton_schulz(nesterov.view(4, -1), "gram").view(4, 2, 3, 3))


class Named(nn.Module):
    """Names DeepSpeed's rule reads: embeddings and an output head stay AdamW's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(11, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv2d(2, 4, 3)
        self.lm_head = nn.Linear(8, 11, bias=False)
        self.frozen = nn.Linear(8, 8)
        self.frozen.weight.requires_grad_(False)


def test_use_muon_tags_and_halves_equal_deepspeeds():
    """set_optimizer_flags' rule and _muon_param_groups' halves (names, order, options, with
    the groups' own lr / weight_decay), settings resolved as MuonWithAuxAdam fills them."""
    model = Named()
    params = {"lr": 0.01, "muon_lr": 0.02, "momentum": 0.9, "weight_decay": 0.1}
    deepspeed.set_optimizer_flags(types.SimpleNamespace(optimizer_name="muon",
                                                        optimizer_params=params), model)
    theirs_tags = {n: p.use_muon for n, p in model.named_parameters()}
    tag_use_muon(model)
    assert {n: p.use_muon for n, p in model.named_parameters()} == theirs_tags
    assert [n for n, t in theirs_tags.items() if t] == ["proj.weight", "conv.weight",
                                                        "frozen.weight"]
    named = dict(model.named_parameters())
    given = [{"params": [named["proj.weight"], named["embed_tokens.weight"],
                         named["frozen.weight"], named["frozen.bias"]], "name": "decay"},
             {"params": [named["proj.bias"], named["norm.weight"], named["conv.weight"]],
              "weight_decay": 0.0, "lr": 0.5, "momentum": 0.8, "eps": 1e-6}]
    theirs = original_muon.MuonWithAuxAdam(
        DeepSpeedEngine._muon_param_groups(given, dict(params))).param_groups
    spec = engine_config({"train_batch_size": 1, "optimizer": {"type": "Muon",
                                                               "params": params}}, 1).optimizer
    ours = muon_param_groups(given, model, spec)
    assert [g["name"] for g in ours] == [g["name"] for g in theirs] == [
        "decay-muon-params", "decay-adam-params", "group1-muon-params", "group1-adam-params"]
    for a, b in zip(ours, theirs):
        assert sorted(map(id, a["params"])) == sorted(map(id, b["params"]))  # Muon sorts its
        keys = ("lr", "momentum", "weight_decay", "ns_method") if b["use_muon"] else \
            ("lr", "betas", "eps", "weight_decay")
        assert {k: a[k] for k in keys} == {k: tuple(b[k]) if k == "betas" else b[k]
                                           for k in keys}, a["name"]


def test_config_defaults_are_muon_with_aux_adams():
    """Without lrs: Muon 0.02, AdamW 3e-4; momentum 0.95, gram, betas (0.9, 0.95), eps 1e-10,
    no weight decay; lr sets both halves, muon_lr / adam_lr each."""
    def spec(params):
        return engine_config({"train_batch_size": 1, "optimizer": {"type": "Muon",
                                                                   "params": params}},
                             1).optimizer

    bare = spec({})
    assert (bare.lr, bare.extra["adam_lr"], bare.momentum, bare.extra["ns_method"],
            bare.betas, bare.eps, bare.weight_decay) == (0.02, 3e-4, 0.95, "gram",
                                                         (0.9, 0.95), 1e-10, 0.0)
    assert (spec({"lr": 0.01}).lr, spec({"lr": 0.01}).extra["adam_lr"]) == (0.01, 0.01)
    both = spec({"lr": 0.01, "muon_lr": 0.03, "adam_lr": 0.001})
    assert (both.lr, both.extra["adam_lr"]) == (0.03, 0.001)


def test_config_problems_name_the_key():
    with pytest.raises(ConfigError) as err:
        engine_config({"train_batch_size": 1, "optimizer": {"type": "Muon", "params": {
            "ns_method": "newton", "per_head_muon": True, "nesterov": False}}}, 1)
    lines = err.value.problems
    assert any("optimizer.params.ns_method" in line and "newton" in line for line in lines)
    assert any("per_head_muon is not built" in line for line in lines)
    assert any("optimizer.params.nesterov is not a parameter of Muon" in line
               for line in lines), lines
