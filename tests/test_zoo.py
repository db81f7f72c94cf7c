"""The model zoo: published parameter counts (computed on the meta device, nothing
allocated), stdlib-readable files, overrides, and clear errors."""
import json

import pytest

from gigatron.models.gpt import count_parameters
from gigatron.models.zoo import ZOO_DIR, list_models, load_config

# Published figures: OpenAI GPT-2 checkpoints (tied, vocab 50257 unpadded, 1024 positions)
# and Meta's Llama 2 / Llama 3 / Llama 3.2 checkpoints.
PUBLISHED = {
    "gpt2-124m": 124_439_808,
    "gpt2-355m": 354_823_168,
    "gpt2-774m": 774_030_080,
    "gpt2-1.5b": 1_557_611_200,
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
    "llama3.2-1b": 1_235_814_400,  # tied embedding
}
# GPT-3 (Brown et al. 2020) gives rounded sizes: check within 3 %.
GPT3_NOMINAL = {"gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9,
                "gpt3-175b": 175e9}
# Mixtures of experts, total parameters as their model cards give them (rounded): check
# within 3 %.
MOE_NOMINAL = {"mixtral-8x7b": 46.7e9, "mixtral-8x22b": 141e9, "qwen3-30b-a3b": 30.5e9,
               "qwen3-235b-a22b": 235e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_equals_published_figure(name):
    overrides = {"make_vocab_size_divisible_by": 1} if name.startswith("gpt2") else {}
    assert count_parameters(load_config(name, **overrides)) == PUBLISHED[name]


def test_gpt3_parameter_counts_match_nominal_sizes():
    for name, nominal in GPT3_NOMINAL.items():
        n = count_parameters(load_config(name, make_vocab_size_divisible_by=1))
        assert abs(n - nominal) / nominal < 0.03, (name, n)


@pytest.mark.parametrize("name", sorted(MOE_NOMINAL))
def test_moe_parameter_counts_match_published_totals(name):
    n = count_parameters(load_config(name))
    assert abs(n - MOE_NOMINAL[name]) / MOE_NOMINAL[name] < 0.03, (name, n)


def test_mixtral_8x7b_count_is_the_published_checkpoint_exactly():
    # the safetensors of mistralai/Mixtral-8x7B-v0.1 hold 46,702,792,704 parameters
    assert count_parameters(load_config("mixtral-8x7b")) == 46_702_792_704


@pytest.mark.parametrize("name, total", [("qwen3-30b-a3b", 30_532_122_624),
                                         ("qwen3-235b-a22b", 235_093_634_560)])
def test_qwen3_moe_count_is_the_published_checkpoint_exactly(name, total):
    """transformers' Qwen3MoeForCausalLM of the published config.json (built on the meta
    device) holds these counts; each layer's q/k norms (2 x 128, --qk-layernorm) included."""
    assert count_parameters(load_config(name)) == total
    assert load_config(name).qk_layernorm
    description = json.loads((ZOO_DIR / f"{name}.json").read_text())["description"]
    assert "no qk-layernorm" not in description and "NOT the published" not in description


def test_deepseek_v3_style_has_its_moe_block():
    cfg = load_config("deepseek-v3-style")
    assert (cfg.num_moe_experts, cfg.moe_router_topk, cfg.moe_router_score_function,
            cfg.moe_router_num_groups, cfg.moe_router_group_topk,
            cfg.moe_router_topk_scaling_factor) == (256, 8, "sigmoid", 8, 4, 2.5)
    assert cfg.moe_router_enable_expert_bias and cfg.moe_shared_expert_intermediate_size
    assert cfg.moe_layer_freq == [0, 0, 0] + [1] * (cfg.num_layers - 3)
    description = json.loads((ZOO_DIR / "deepseek-v3-style.json").read_text())["description"]
    assert "deepseek-v3-671b is, with multi-latent attention" in description


def test_list_models_has_every_issue_model_and_debug_models():
    names = set(list_models())
    assert set(PUBLISHED) | set(GPT3_NOMINAL) | set(MOE_NOMINAL) | \
        {"debug-gpt2", "debug-llama", "deepseek-v3-style"} <= names


def test_zoo_files_are_plain_json_with_a_description():
    for name in list_models():
        data = json.loads((ZOO_DIR / f"{name}.json").read_text())
        assert isinstance(data.get("description"), str) and data["num_layers"] > 0


def test_llama_models_have_llama_architecture():
    cfg = load_config("llama3-8b")
    assert (cfg.position_embedding_type, cfg.normalization, cfg.activation) == \
        ("rope", "RMSNorm", "swiglu")
    assert cfg.untie_embeddings_and_output_weights and not cfg.add_bias_linear
    assert cfg.num_query_groups == 8 and cfg.rotary_base == 500000.0


def test_overrides_replace_fields():
    cfg = load_config("gpt2-124m", seq_length=512, params_dtype="bf16")
    assert cfg.seq_length == 512 and str(cfg.params_dtype) == "torch.bfloat16"


def test_unknown_model_and_unknown_override_are_named():
    with pytest.raises(ValueError, match="gpt9"):
        load_config("gpt9")
    with pytest.raises(ValueError, match="num_layer"):
        load_config("gpt2-124m", num_layer=3)
