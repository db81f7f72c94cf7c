"""DeepSeek-V3's routing is Megatron's router with sigmoid scores, group-limited top-k,
the expert bias that picks experts but does not weight them, normalised top-k weights and
the top-k scaling factor: on the same gating weights, expert bias and tokens, gigatron's
Router gives transformers' DeepseekV3TopkRouter's experts and weights (fp32), and the
first layers stay dense by --moe-layer-freq as DeepseekV3's first_k_dense_replace.

Megatron ranks a group by the sum of its best topk / group_topk scores, transformers by its
best 2 (DeepSeek-V3's 8 / 4): the two agree where that is 2 or where every group may be
picked (one group: Moonlight, Kimi K2); with 12 experts in 3 groups, top-3 from 1 group
they differ (tried), and the Hugging Face converter refuses such configs."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from gigatron.models.config import TransformerConfig  # noqa: E402
from gigatron.models.moe.config_checks import moe_layer_pattern  # noqa: E402
from gigatron.models.moe.router import Router, RouterConfig  # noqa: E402

HIDDEN = 24


def hf_router(experts, topk, groups, group_topk, scaling):
    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=experts, num_experts_per_tok=topk,
        n_group=groups, topk_group=group_topk, routed_scaling_factor=scaling,
        norm_topk_prob=True, num_hidden_layers=1, num_mtp_layers=0)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(experts + topk)
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, HIDDEN, generator=g))
        # a bias large enough to change the choice of experts (DeepSeek's correction bias)
        router.e_score_correction_bias.copy_(0.3 * torch.randn(experts, generator=g))
    return router


@pytest.mark.parametrize("experts, topk, groups, group_topk, scaling", [
    (16, 4, 4, 2, 2.5),   # DeepSeek-V3's shape in small: 2 of 4 groups, top-2 per group rank
    (8, 2, 1, 1, 1.0),    # one group (Moonlight, Kimi K2): plain top-k of biased scores
    (12, 4, 3, 2, 1.5),
])
def test_router_equals_transformers_deepseek_v3_router(experts, topk, groups, group_topk,
                                                       scaling):
    hf = hf_router(experts, topk, groups, group_topk, scaling)
    ours = Router(RouterConfig(num_experts=experts, topk=topk, score_function="sigmoid",
                               topk_scaling_factor=scaling, num_groups=groups,
                               group_topk=group_topk, enable_expert_bias=True),
                  HIDDEN, load_balancing_type="none", router_dtype="fp32")
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ours.expert_bias.copy_(hf.e_score_correction_bias)
    tokens = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, weights, indices = hf(tokens)
        out = ours(tokens, seq_length=64)
    expected = torch.zeros(64, experts).scatter(1, indices, weights)
    assert torch.equal(out.routing_map, expected > 0)
    torch.testing.assert_close(out.probs, expected, rtol=1e-6, atol=1e-7)
    # the bias changed the choice somewhere, and weighs nothing: weights are the raw scores'
    unbiased = Router(RouterConfig(num_experts=experts, topk=topk, score_function="sigmoid",
                                   num_groups=groups, group_topk=group_topk), HIDDEN,
                      load_balancing_type="none")
    with torch.no_grad():
        unbiased.weight.copy_(hf.weight)
        assert not torch.equal(unbiased(tokens, 64).routing_map, out.routing_map)


def test_first_k_dense_layers_as_moe_layer_freq_list():
    config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2,
                               vocab_size=32, num_moe_experts=4, add_bias_linear=False,
                               moe_layer_freq=[0, 1, 1, 1])
    assert moe_layer_pattern(config) == [False, True, True, True]
