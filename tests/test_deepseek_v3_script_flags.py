"""The flags of Megatron-LM's DeepSeek-V3 script that gigatron once refused (issue 39).

--moe-router-force-load-balancing routes by random logits with the gradient passed straight
through (Megatron-Core's RandomSTE); --log-num-zeros-in-grad counts the zero gradient
entries (the same count as plain torch's grads); --recompute-modules layernorm and
mla_up_proj recompute their submodule in backward and train the same numbers as none.
"""
import copy

import pytest
import torch

from gigatron.models.config import TransformerConfig
from gigatron.models.gpt import GPTModel
from gigatron.models.moe.router import Router, RouterConfig
from gigatron.parallel.zero import ZeroConfig, build_zero


def test_force_load_balancing_routes_by_random_logits_and_passes_the_gradient_through():
    router = Router(RouterConfig(num_experts=8, topk=2, force_load_balancing=True), 16)
    x = torch.randn(10, 16)
    torch.manual_seed(7)
    logits = router.gating(x)
    torch.manual_seed(7)
    assert torch.equal(logits, torch.empty(10, 8).normal_())  # not the router's weights
    grad = torch.randn(10, 8)
    logits.backward(grad)
    torch.testing.assert_close(router.weight.grad, grad.t() @ x)


def test_num_zeros_in_grad_counts_the_zero_entries_of_the_gradients():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    x = torch.randn(2, 4)
    reference(x).sum().backward()
    expected = sum(int((p.grad == 0).sum()) for p in reference.parameters())
    assert expected > 0  # the ReLU's dead units
    zero = build_zero([model], ZeroConfig(zero_stage=1, lr=1e-3))
    zero.count_zeros_in_grad = True
    zero.zero_grad()
    zero.backward(model(x).sum())
    assert float(zero.step().num_zeros) == expected


def _mla_step(modules):
    """(loss, grads, calls of the first layer's input norm and query up-projection)."""
    recompute = {} if modules is None else dict(recompute_granularity="selective",
                                                recompute_modules=modules)
    c = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=64,
                          seq_length=8, multi_latent_attention=True, q_lora_rank=16,
                          kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                          position_embedding_type="rope", normalization="RMSNorm",
                          qk_layernorm=True, add_bias_linear=False, hidden_dropout=0.0,
                          attention_dropout=0.0, **recompute)
    model = GPTModel(c, seed=3).train()
    layer = next(m for m in model.modules() if hasattr(m, "pre_mlp_layernorm"))
    calls = {"norm": 0, "up": 0}
    norm, normalize = layer.input_layernorm, layer.input_layernorm._normalize
    norm._normalize = lambda x: calls.__setitem__("norm", calls["norm"] + 1) or normalize(x)
    layer.self_attention.linear_q_up_proj.register_forward_hook(lambda *a: calls.__setitem__(
        "up", calls["up"] + 1))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("modules", [["layernorm"], ["mla_up_proj"],
                                     ["layernorm", "mla_up_proj", "core_attn"]])
def test_layernorm_and_mla_up_proj_recompute_in_backward_with_the_same_numbers(modules):
    loss, grads, calls = _mla_step(modules)
    ref_loss, ref_grads, ref_calls = _mla_step(None)
    assert torch.equal(loss, ref_loss)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=0, atol=1e-7, msg=n)
    assert ref_calls == {"norm": 1, "up": 1}
    assert calls == {"norm": 1 + ("layernorm" in modules), "up": 1 + ("mla_up_proj" in modules)}
