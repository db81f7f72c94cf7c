"""RoutedExperts: equal to Hugging Face's Mixtral experts, loop == grouped, edge cases of routing."""
from typing import Tuple

import pytest
import torch
import torch.nn.functional as F

from gigatron.models.moe.experts import RoutedExperts

HIDDEN, FFN, EXPERTS, TOP_K, TOKENS = 32, 64, 8, 2, 40
TOL = dict(atol=1e-5, rtol=1e-5)


def _mixtral_block(seed: int = 0) -> torch.nn.Module:
    """A tiny random MixtralSparseMoeBlock; the installed transformers leaves weights empty."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, hidden_act="silu", router_jitter_noise=0.0)
    config._experts_implementation = "eager"  # the reference loop, not HF's own grouped kernels
    torch.manual_seed(seed)
    block = MixtralSparseMoeBlock(config).eval()
    for param in block.parameters():
        torch.nn.init.normal_(param, std=0.2)
    return block


def _mixtral_routing(x: torch.Tensor, router_weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Mixtral's routing as dense probs/routing_map: softmax over all, top-k, renormalise."""
    scores = torch.softmax(F.linear(x, router_weight).float(), dim=-1)
    top_values, top_indices = torch.topk(scores, TOP_K, dim=-1)
    top_values = top_values / top_values.sum(dim=-1, keepdim=True)
    probs = torch.zeros_like(scores).scatter(1, top_indices, top_values)
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top_indices, True)
    return probs, routing_map


def _experts_from_mixtral(block: torch.nn.Module, grouped: bool) -> RoutedExperts:
    """RoutedExperts holding the block's experts: gate_up_proj [E, 2f, h] is fc1^T as [gate; up]."""
    experts = RoutedExperts(EXPERTS, HIDDEN, FFN, activation="swiglu", grouped_gemm=grouped)
    with torch.no_grad():
        experts.weight1.copy_(block.experts.gate_up_proj.transpose(1, 2))
        experts.weight2.copy_(block.experts.down_proj.transpose(1, 2))
    return experts


def _dense_reference(experts: RoutedExperts, x: torch.Tensor, probs: torch.Tensor,
                     routing_map: torch.Tensor) -> torch.Tensor:
    """Per token, per chosen expert: p * MLP_e(x), no permutation at all."""
    rows = []
    for t in range(x.shape[0]):
        total = torch.zeros_like(x[t])
        for e in routing_map[t].nonzero().flatten().tolist():
            h = x[t] @ experts.weight1[e]
            if experts.swiglu:
                gate, up = h.chunk(2)
                h = F.silu(gate) * up
            else:
                h = experts.activation(h)
            total = total + probs[t, e] * (h @ experts.weight2[e])
        rows.append(total)
    return torch.stack(rows)


def _random_routing(seed: int, tokens: int = TOKENS) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random inputs, top-2 routing with distinct probabilities per token."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator)
    scores = torch.rand(tokens, EXPERTS, generator=generator)
    top_values, top_indices = torch.topk(scores, TOP_K, dim=-1)
    probs = torch.zeros_like(scores).scatter(1, top_indices, top_values)
    return x, probs, probs > 0


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_swiglu_matches_mixtral_block_outputs_and_grads(grouped: bool) -> None:
    block = _mixtral_block()
    experts = _experts_from_mixtral(block, grouped)
    x = torch.randn(2, TOKENS // 2, HIDDEN)
    x_hf = x.clone().requires_grad_()
    x_ours = x.reshape(-1, HIDDEN).clone().requires_grad_()
    expected = block(x_hf).reshape(-1, HIDDEN)
    probs, routing_map = _mixtral_routing(x_ours, block.gate.weight)
    _, _, hf_indices = block.gate(x.reshape(-1, HIDDEN))
    assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, hf_indices, True))
    assert routing_map.sum(0).min() > 0, "every expert should get tokens in this check"
    got = experts(x_ours, probs, routing_map)
    torch.testing.assert_close(got, expected, **TOL)

    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    (got * upstream).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_hf.grad.reshape(-1, HIDDEN), **TOL)
    torch.testing.assert_close(experts.weight1.grad, block.experts.gate_up_proj.grad.transpose(1, 2), **TOL)
    torch.testing.assert_close(experts.weight2.grad, block.experts.down_proj.grad.transpose(1, 2), **TOL)


def _run(experts: RoutedExperts, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
    """Output and the grads of input, probs and both weights for a fixed random upstream grad."""
    experts.zero_grad()
    x = x.clone().requires_grad_()
    probs = probs.clone().requires_grad_()
    out = experts(x, probs, routing_map)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * upstream).sum().backward()
    return out, x.grad, probs.grad, experts.weight1.grad.clone(), experts.weight2.grad.clone()


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_grouped_gemm_equals_loop_outputs_and_grads(activation: str, monkeypatch) -> None:
    torch.manual_seed(1)
    loop = RoutedExperts(EXPERTS, HIDDEN, FFN, activation=activation, init_method_std=0.2)
    grouped = RoutedExperts(EXPERTS, HIDDEN, FFN, activation=activation, grouped_gemm=True)
    grouped.load_state_dict(loop.state_dict())
    x, probs, routing_map = _random_routing(seed=2)
    calls = []
    if hasattr(torch, "_grouped_mm"):
        real = torch._grouped_mm
        monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    ran = "torch._grouped_mm" if grouped.uses_grouped_mm(x) else "the loop (fallback)"
    print(f"grouped path ran {ran} on torch {torch.__version__}")
    for a, b in zip(_run(loop, x, probs, routing_map), _run(grouped, x, probs, routing_map)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
    assert len(calls) == (2 if grouped.uses_grouped_mm(x) else 0)
    if hasattr(torch, "_grouped_mm") and tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 13):
        assert calls, "torch >= 2.13 serves _grouped_mm on CPU in fp32: the grouped path must use it"


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_gelu_matches_dense_per_token_reference(grouped: bool) -> None:
    torch.manual_seed(3)
    experts = RoutedExperts(EXPERTS, HIDDEN, FFN, activation="gelu", grouped_gemm=grouped,
                            init_method_std=0.2)
    x, probs, routing_map = _random_routing(seed=4)
    torch.testing.assert_close(experts(x, probs, routing_map),
                               _dense_reference(experts, x, probs, routing_map), **TOL)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_unrouted_token_is_zero_and_empty_expert_gets_zero_grad(grouped: bool) -> None:
    torch.manual_seed(5)
    experts = RoutedExperts(EXPERTS, HIDDEN, FFN, grouped_gemm=grouped, init_method_std=0.2)
    x, probs, routing_map = _random_routing(seed=6)
    routing_map[3] = False          # token 3 goes nowhere (e.g. dropped by capacity)
    routing_map[:, 5] = False       # expert 5 gets no tokens
    probs = probs * routing_map
    out, _, _, grad1, grad2 = _run(experts, x, probs, routing_map)
    assert torch.equal(out[3], torch.zeros(HIDDEN))
    assert out.abs().sum(dim=1).min() == 0 and (out.abs().sum(dim=1) > 0).sum() == TOKENS - 1
    assert torch.equal(grad1[5], torch.zeros_like(grad1[5]))
    assert torch.equal(grad2[5], torch.zeros_like(grad2[5]))
    assert grad1[0].abs().sum() > 0
    torch.testing.assert_close(out, _dense_reference(experts, x, probs, routing_map), **TOL)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_no_token_routed_at_all_gives_zeros(grouped: bool) -> None:
    experts = RoutedExperts(EXPERTS, HIDDEN, FFN, grouped_gemm=grouped)
    x = torch.randn(4, HIDDEN, requires_grad=True)
    routing_map = torch.zeros(4, EXPERTS, dtype=torch.bool)
    out = experts(x, torch.zeros(4, EXPERTS), routing_map)
    assert torch.equal(out, torch.zeros(4, HIDDEN))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_wrong_unpermute_order_is_caught_by_the_reference(monkeypatch) -> None:
    torch.manual_seed(8)
    experts = RoutedExperts(EXPERTS, HIDDEN, FFN, init_method_std=0.2)
    x, probs, routing_map = _random_routing(seed=9)
    reference = _dense_reference(experts, x, probs, routing_map)
    from gigatron.parallel.expert import dispatch as dispatch_module
    real_permute = dispatch_module.permute

    def swapped_rows(hidden, routing_map):
        """The right rows, but sent back to a neighbouring token's slot."""
        rows, token_indices, counts = real_permute(hidden, routing_map)
        return rows, (token_indices + 1) % hidden.shape[0], counts

    monkeypatch.setattr(dispatch_module, "permute", swapped_rows)
    assert not torch.allclose(experts(x, probs, routing_map), reference, **TOL)


def test_grouped_gemm_falls_back_to_loop_for_unaligned_sizes() -> None:
    torch.manual_seed(10)
    loop = RoutedExperts(4, 6, 10, init_method_std=0.2)
    grouped = RoutedExperts(4, 6, 10, grouped_gemm=True)
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(5, 6)
    probs = torch.softmax(torch.randn(5, 4), dim=-1)
    routing_map = probs > 0.2
    assert not grouped.uses_grouped_mm(x)  # 6 fp32 values = 24 bytes, not a multiple of 16
    torch.testing.assert_close(grouped(x, probs, routing_map), loop(x, probs, routing_map))


@pytest.mark.parametrize("bad, message", [
    (dict(hidden=torch.zeros(3, 4, HIDDEN)), "hidden has shape"),
    (dict(probs=torch.zeros(3, EXPERTS + 1)), "probs has shape"),
    (dict(routing_map=torch.zeros(3, EXPERTS)), "routing_map has dtype"),
])
def test_bad_inputs_name_the_argument(bad: dict, message: str) -> None:
    experts = RoutedExperts(EXPERTS, HIDDEN, FFN)
    args = dict(hidden=torch.zeros(3, HIDDEN), probs=torch.zeros(3, EXPERTS),
                routing_map=torch.zeros(3, EXPERTS, dtype=torch.bool))
    args.update(bad)
    with pytest.raises(ValueError, match=message):
        experts(**args)
