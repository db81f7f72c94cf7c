"""The MoE router equals Megatron-Core 0.16's own routing and losses, values and gradients."""
from __future__ import annotations

import itertools
import types
import warnings
from typing import Any, Callable, Optional

import pytest
import torch

from gigatron.models.moe import router as moe
from gigatron.models.moe.router import RouterConfig

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    moe_utils = pytest.importorskip(
        "megatron.core.transformer.moe.moe_utils",
        reason="megatron-core is not importable: nothing to compare the router against")
    from megatron.core.transformer.moe.router import TopKRouter

EXPERTS, TOPK = 8, 2
SEEDS = ((0, 32), (1, 48), (2, 64))  # (seed, tokens)
CAPACITIES = (None, (1.0, "probs", False), (1.0, "probs", True),
              (1.0, "position", False), (1.0, "position", True), (5.0, "probs", False))


def _logits(seed: int, tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, EXPERTS, generator=generator).requires_grad_(True)


def _bias(seed: int) -> torch.Tensor:
    # Of the order of the sigmoid scores' spread, so the bias does change choices.
    return 0.2 * torch.randn(EXPERTS, generator=torch.Generator().manual_seed(100 + seed))


def _routing_configs() -> list[tuple[RouterConfig, bool]]:
    """(config, use expert bias) for every combination Megatron accepts."""
    cases = []
    # (topk, num_groups, group_topk). Not topk 2 from 2 of 4 groups: each group would be
    # ranked by its best expert, which picks the plain top-2 and tests nothing new.
    groupings = ((TOPK, None, None), (4, 4, 2))
    for score, pre, scale, (topk, groups, group_topk), bias, capacity in itertools.product(
            ("softmax", "sigmoid"), (False, True), (None, 2.5), groupings, (False, True),
            CAPACITIES):
        if bias and score != "sigmoid":
            continue
        factor, policy, pad = capacity or (None, "probs", False)
        config = RouterConfig(
            num_experts=EXPERTS, topk=topk, score_function=score, pre_softmax=pre,
            topk_scaling_factor=scale, num_groups=groups, group_topk=group_topk,
            enable_expert_bias=bias,
            capacity_factor=factor, drop_policy=policy, pad_to_capacity=pad)
        cases.append((config, bias))
    return cases


def _megatron_route(logits: torch.Tensor, config: RouterConfig,
                    bias: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """What TopKRouter.routing computes for probs and routing_map, through Megatron's functions."""
    probs, routing_map = moe_utils.topk_routing_with_score_function(
        logits, config.topk, use_pre_softmax=config.pre_softmax, num_groups=config.num_groups,
        group_topk=config.group_topk, scaling_factor=config.topk_scaling_factor,
        score_function=config.score_function, expert_bias=bias)
    if config.capacity_factor is not None:
        probs, routing_map = moe_utils.apply_router_token_dropping(
            probs, routing_map, router_topk=config.topk,
            capacity_factor=config.capacity_factor, drop_policy=config.drop_policy,
            pad_to_capacity=config.pad_to_capacity)
    return probs, routing_map


def _grad(fn: Callable[[torch.Tensor], torch.Tensor], logits: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(fn(logits), logits)
    return grad


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)


def _case_id(config: RouterConfig, use_bias: bool) -> str:
    groups = f"-groups{config.num_groups}of{config.group_topk}" if config.group_topk else ""
    capacity = (f"-cap{config.capacity_factor}-{config.drop_policy}"
                f"{'-pad' if config.pad_to_capacity else ''}" if config.capacity_factor else "")
    return (f"{config.score_function}{'-pre' if config.pre_softmax else ''}-top{config.topk}"
            f"{'-scaled' if config.topk_scaling_factor else ''}{groups}"
            f"{'-bias' if use_bias else ''}{capacity}")


@pytest.mark.parametrize("config,use_bias", _routing_configs(),
                         ids=[_case_id(*case) for case in _routing_configs()])
def test_route_matches_megatron_probs_map_and_grads(config: RouterConfig, use_bias: bool) -> None:
    for seed, tokens in SEEDS:
        logits = _logits(seed, tokens)
        bias = _bias(seed) if use_bias else None
        probs, routing_map = moe.route(logits, config, bias)
        want_probs, want_map = _megatron_route(logits, config, bias)
        assert torch.equal(routing_map, want_map)
        _assert_close(probs, want_probs)
        if seed:
            continue  # the gradient on one seed is enough, and keeps the file fast
        weights = torch.randn(tokens, EXPERTS, generator=torch.Generator().manual_seed(seed))
        _assert_close(_grad(lambda x: (moe.route(x, config, bias)[0] * weights).sum(), logits),
                      _grad(lambda x: (_megatron_route(x, config, bias)[0] * weights).sum(),
                            logits))


def test_the_options_change_the_routing() -> None:
    """Guards the comparison above against cases where every option gives the same answer."""
    logits = _logits(0, 64)
    base = RouterConfig(num_experts=EXPERTS, score_function="sigmoid")
    _, plain = moe.route(logits, base)
    _, biased = moe.route(logits, base, _bias(0))
    _, plain4 = moe.route(logits, RouterConfig(num_experts=EXPERTS, topk=4))
    _, grouped = moe.route(logits, RouterConfig(num_experts=EXPERTS, topk=4, num_groups=4,
                                                group_topk=2))
    _, dropped = moe.route(logits, RouterConfig(num_experts=EXPERTS, score_function="sigmoid",
                                                capacity_factor=1.0))
    assert not torch.equal(plain, biased)
    assert not torch.equal(plain4, grouped)
    assert dropped.sum() < plain.sum() and (dropped.sum(dim=0) <= 16).all()


def _fake_router(topk: int, load_balancing_type: str, coeff: float,
                 captured: list[torch.Tensor]) -> Any:
    """Just enough of a TopKRouter (one tensor x context parallel rank) to run its loss methods."""
    fake = types.SimpleNamespace(
        topk=topk, tp_cp_group=types.SimpleNamespace(size=lambda: 1),
        config=types.SimpleNamespace(num_moe_experts=EXPERTS, moe_router_fusion=False))
    fake.get_aux_loss_coeff = lambda kind: coeff if kind == load_balancing_type else 0.0

    def attach(probs: torch.Tensor, _coeff: float, loss: torch.Tensor, *args: Any,
               **kwargs: Any) -> torch.Tensor:
        captured.append(loss)
        return probs

    fake.attach_and_log_load_balancing_loss = attach
    return fake


def _megatron_balancing_loss(kind: str, logits: torch.Tensor, score: str, coeff: float,
                             seq_length: int) -> torch.Tensor:
    """The loss TopKRouter attaches for ``kind``, computed by its own methods."""
    captured: list[torch.Tensor] = []
    fake = _fake_router(TOPK, kind, coeff, captured)
    routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, TOPK, score)
    probs = torch.zeros_like(logits)
    if kind == "aux_loss":
        TopKRouter._apply_aux_loss(fake, probs, scores, routing_map)
    else:
        TopKRouter._apply_seq_aux_loss(fake, probs, scores, routing_map, seq_length,
                                       logits.shape[0] // seq_length)
    (loss,) = captured
    return loss


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_balancing_losses_match_megatron_value_and_grad(kind: str, score: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # One tensor x context parallel rank: the all-reduce of the counts is the identity.
    monkeypatch.setattr(moe_utils, "reduce_from_tensor_model_parallel_region",
                        lambda tensor, group: tensor)
    coeff = 1e-2
    for seed, tokens in SEEDS:
        seq_length = tokens // 4  # batch of 4 sequences, tokens sequence-major
        logits = _logits(seed, tokens)

        def ours(x: torch.Tensor) -> torch.Tensor:
            if kind == "aux_loss":
                return moe.aux_loss(x, TOPK, score, coeff)  # type: ignore[arg-type]
            return moe.seq_aux_loss(x, seq_length, TOPK, score, coeff)  # type: ignore[arg-type]

        def theirs(x: torch.Tensor) -> torch.Tensor:
            return _megatron_balancing_loss(kind, x, score, coeff, seq_length)

        _assert_close(ours(logits), theirs(logits))
        _assert_close(_grad(ours, logits), _grad(theirs, logits))


def test_a_missing_topk_or_token_factor_is_caught() -> None:
    """The tolerance above is tight enough to see a wrong normalisation convention."""
    logits = _logits(0, 32)
    right = moe.aux_loss(logits, TOPK, "softmax", 1e-2)
    routing_map, scores = moe.scores_for_aux_loss(logits, TOPK, "softmax")
    no_topk = moe.switch_load_balancing_loss(scores, routing_map.sum(0), 32, 1, EXPERTS, 1e-2)
    assert (no_topk - right).abs() > 1e-6
    seq = moe.seq_aux_loss(logits, 8, TOPK, "softmax", 1e-2)
    assert (seq - right).abs() > 1e-6  # per-sequence counts differ from the batch's


def test_z_loss_matches_megatron_value_and_grad() -> None:
    for seed, tokens in SEEDS:
        logits = 3 * _logits(seed, tokens).detach()
        logits.requires_grad_(True)
        _assert_close(moe.z_loss(logits, 1e-3), moe_utils.z_loss_func(logits, 1e-3))
        _assert_close(_grad(lambda x: moe.z_loss(x, 1e-3), logits),
                      _grad(lambda x: moe_utils.z_loss_func(x, 1e-3), logits))


def test_expert_bias_update_matches_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    # One data-parallel rank: Megatron's all-reduce of the counts is the identity.
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group",
                        lambda with_context_parallel=False: None)
    for seed, tokens in SEEDS:
        config = RouterConfig(num_experts=EXPERTS, score_function="sigmoid",
                              enable_expert_bias=True, bias_update_rate=1e-3)
        bias = _bias(seed)
        _, routing_map = moe.route(_logits(seed, tokens).detach(), config, bias)
        counts = routing_map.sum(dim=0).float()
        ours = moe.updated_expert_bias(counts, bias, config.bias_update_rate)
        theirs = moe_utils.get_updated_expert_bias(counts.clone(), bias, 1e-3)
        _assert_close(ours, theirs)
        assert not torch.equal(ours, bias)


@pytest.mark.parametrize("settings,flag", [
    (dict(topk=9), "--moe-router-topk"),
    (dict(topk=1), "--moe-router-pre-softmax"),
    (dict(enable_expert_bias=True), "--moe-router-score-function sigmoid"),
    (dict(group_topk=2), "--moe-router-num-groups"),
    (dict(num_groups=3, group_topk=2), "--moe-router-num-groups"),
    (dict(num_groups=4, group_topk=1, topk=3), "--moe-router-group-topk"),
    (dict(pad_to_capacity=True), "--moe-expert-capacity-factor"),
    (dict(drop_policy="random"), "--moe-token-drop-policy"),
])
def test_bad_settings_name_the_flag(settings: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        RouterConfig(num_experts=EXPERTS, **settings)


@pytest.mark.parametrize("seed,tokens", SEEDS)
def test_sinkhorn_matches_megatron(seed: int, tokens: int) -> None:
    cost = _logits(seed, tokens).detach()
    theirs = moe_utils.sinkhorn(cost.clone())
    _assert_close(moe.sinkhorn(cost), theirs)
    # balanced: every expert's column sums to 1/E, every token's row to about 1/T
    torch.testing.assert_close(theirs.sum(0), torch.full((EXPERTS,), 1 / EXPERTS))


@pytest.mark.parametrize("topk", [1, TOPK])
@pytest.mark.parametrize("training", [True, False], ids=["training", "eval"])
def test_sinkhorn_routing_matches_megatron_probs_map_and_grads(topk: int, training: bool) -> None:
    from megatron.core.transformer.moe.router import TopKRouter
    fake = types.SimpleNamespace(topk=topk, training=training,
                                 config=types.SimpleNamespace(moe_aux_loss_coeff=0.0))
    for seed, tokens in SEEDS:
        logits = _logits(seed, tokens)
        ours = moe.sinkhorn_routing(logits, topk, training)
        theirs = TopKRouter.sinkhorn_load_balancing(fake, logits)
        assert torch.equal(ours[1], theirs[1])
        _assert_close(ours[0], theirs[0])
        _assert_close(_grad(lambda x: (moe.sinkhorn_routing(x, topk, training)[0] ** 2).sum(),
                            logits),
                      _grad(lambda x: (TopKRouter.sinkhorn_load_balancing(fake, x)[0] ** 2)
                            .sum(), logits))
    if training:  # the balanced choice is not the plain top-k of the scores
        logits = _logits(0, 32)
        plain = logits.topk(topk, dim=1).indices
        chosen = moe.sinkhorn_routing(logits, topk, True)[1]
        assert not torch.equal(chosen, torch.zeros_like(chosen).scatter(1, plain, True))
