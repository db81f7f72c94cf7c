"""The DeepSeek-V3 family in the zoo: deepseek-v3-671b, kimi-k2-1t, moonlight-16b-a3b and
deepseek-v2-lite hold their publishers' total and active parameter counts (computed on the
meta device; active: every parameter but the routed experts a token is not sent to and the
untied input embedding, models/gpt.py), within 3 % of the rounded published figures, and
build multi-latent attention with their routing."""
import pytest

from gigatron.models.gpt import count_active_parameters, count_parameters
from gigatron.models.zoo import load_config
from gigatron.training.observe.flops import flops_per_token, matmul_parameter_count

# name -> (total, active) as the model cards / papers give them
PUBLISHED = {
    "deepseek-v3-671b": (671e9, 37e9),   # DeepSeek-V3 report: 671B total, 37B activated
    "kimi-k2-1t": (1e12, 32e9),          # Kimi K2 card: 1T total, 32B activated
    "moonlight-16b-a3b": (16e9, 3e9),    # Moonlight card: 16B total, 3B activated
    "deepseek-v2-lite": (15.7e9, 2.4e9),  # DeepSeek-V2 report: 15.7B total, 2.4B activated
}
# Moonlight's 3B counts its input embedding (2.58B without, 2.91B with it)
WITH_EMBEDDING = {"moonlight-16b-a3b"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_total_and_active_counts_equal_the_published_figures(name):
    config = load_config(name)
    total, active = count_parameters(config), count_active_parameters(config)
    if name in WITH_EMBEDDING:
        active += config.padded_vocab_size() * config.hidden_size
    published_total, published_active = PUBLISHED[name]
    assert abs(total - published_total) / published_total < 0.03, (name, total)
    assert abs(active - published_active) / published_active < 0.03, (name, active)


def test_deepseek_v3_671b_builds_mla_yarn_and_group_limited_routing():
    config = load_config("deepseek-v3-671b")
    assert count_parameters(config) == 671_026_404_352  # + 58 x 256 expert-bias buffers
    assert config.multi_latent_attention and config.rope_type == "yarn"
    assert (config.q_lora_rank, config.kv_lora_rank, config.moe_router_num_groups,
            config.moe_router_group_topk, config.moe_layer_freq[:4]) == (1536, 512, 8, 4,
                                                                         [0, 0, 0, 1])


def test_dense_models_have_no_separate_active_count():
    config = load_config("llama3-8b")
    assert count_active_parameters(config) == count_parameters(config) - \
        config.padded_vocab_size() * config.hidden_size


@pytest.mark.parametrize("name", ["deepseek-v3-671b", "moonlight-16b-a3b"])
def test_mfu_counts_mla_parameters_and_attention_width(name):
    """N of the FLOPs formula is the active count (MLA's projections, not a standard
    attention's), and the score term uses MLA's head sizes."""
    config = load_config(name)
    n = matmul_parameter_count(config)
    assert n == count_active_parameters(config)
    heads, q_head = config.num_attention_heads, config.qk_head_dim + config.qk_pos_emb_head_dim
    width = heads * (q_head + config.v_head_dim)
    assert flops_per_token(config) == 6.0 * n + 6.0 * config.num_layers * width * \
        config.seq_length


def test_the_pretrain_banner_prints_the_active_count_of_moe_models():
    from gigatron.training.run.pretrain import _active_phrase

    config = load_config("moonlight-16b-a3b")
    assert _active_phrase(config) == " (2,579,230,208 active)"
    assert _active_phrase(load_config("llama3-8b")) == ""
