"""Megatron-LM's multi-latent attention and YaRN flags: each lands in its TransformerConfig
field with Megatron's meaning, left out they give Megatron-LM's defaults (--rope-type: yarn
with MLA, MLATransformerConfig's), and each misuse is one line naming the flag."""
import pytest

from gigatron.training.config.arguments import parse_args
from gigatron.training.config.megatron.catalog import MEGATRON_LM, entries
from gigatron.training.config.megatron.doc import megatron_flag_note
from gigatron.training.config.megatron.mla import MLA_FIELDS
from gigatron.training.config.validation import ConfigError

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 128 "
        "--disable-bias-linear --swiglu --normalization RMSNorm "
        "--position-embedding-type rope").split()
MLA = BASE + ["--multi-latent-attention"]

CASES = [
    ("--multi-latent-attention", "multi_latent_attention", True),
    ("--q-lora-rank 24", "q_lora_rank", 24),
    ("--kv-lora-rank 16", "kv_lora_rank", 16),
    ("--qk-head-dim 8", "qk_head_dim", 8),
    ("--qk-pos-emb-head-dim 16", "qk_pos_emb_head_dim", 16),
    ("--v-head-dim 4", "v_head_dim", 4),
    ("--rope-type rope", "rope_type", "rope"),
    ("--rotary-scaling-factor 40", "rotary_scaling_factor", 40.0),
    ("--mscale 0.707", "mscale", 0.707),
    ("--mscale-all-dim 0.707", "mscale_all_dim", 0.707),
    ("--yarn-original-max-position-embeddings 8", "original_max_position_embeddings", 8),
    ("--yarn-beta-fast 16", "beta_fast", 16.0),
    ("--yarn-beta-slow 2", "beta_slow", 2.0),
    ("--yarn-correction-range-round-to-int", "yarn_correction_range_round_to_int", True),
    ("--no-yarn-correction-range-round-to-int", "yarn_correction_range_round_to_int", False),
    ("--mla-latent-norm-epsilon 1e-6", "mla_latent_norm_epsilon", 1e-6),
]
# gigatron's own (Megatron-Core's latent norms take --norm-epsilon): default None, that one
OWN = {"--mla-latent-norm-epsilon"}


@pytest.mark.parametrize("flags, field, value", CASES, ids=[c[0] for c in CASES])
def test_each_mla_flag_sets_its_transformer_config_field(flags, field, value):
    model = parse_args(MLA + flags.split(), 1).model
    assert getattr(model, field) == value


def test_every_mla_flag_has_a_case_and_megatrons_default():
    flags = {word for case in CASES for word in case[0].split() if word.startswith("--")}
    megatron = {names[0]: default for _, names, default in entries(MEGATRON_LM)}
    model = parse_args(MLA, 1).model
    for name, field in MLA_FIELDS.items():
        flag = f"--{name.replace('_', '-')}"
        assert flag in flags and (flag in megatron) != (flag in OWN), flag
        if flag in ("--multi-latent-attention",) or flag in OWN:
            continue  # given; not Megatron's
        default = megatron[flag]
        if flag == "--rope-type":
            default = "yarn"  # None: MLATransformerConfig's default
        elif flag == "--yarn-original-max-position-embeddings":
            default = 4096  # None: MLATransformerConfig's original_max_position_embeddings
        elif flag in ("--yarn-beta-fast", "--yarn-beta-slow"):
            default = {"--yarn-beta-fast": 32.0, "--yarn-beta-slow": 1.0}[flag]
        elif flag == "--yarn-correction-range-round-to-int":
            default = True
        assert getattr(model, field) == default, (flag, getattr(model, field), default)
        assert megatron_flag_note(flag) is None, flag  # supported, not explained away


def test_a_model_without_mla_keeps_rope_and_refuses_rope_type_yarn():
    assert parse_args(BASE, 1).model.rope_type == "rope"
    with pytest.raises(ConfigError) as error:
        parse_args(BASE + ["--rope-type", "yarn"], 1)
    assert str(error.value).count("--rope-type yarn needs --multi-latent-attention") == 1


@pytest.mark.parametrize("flags, line", [
    ("--kv-lora-rank 0", "--kv-lora-rank must be > 0, got 0"),
    ("--group-query-attention", "--multi-latent-attention and --group-query-attention are "
                                "exclusive"),
    ("--q-lora-rank 9 --tensor-model-parallel-size 2",
     "q-lora-rank (9) must be divisible by the tensor-parallel size (2)"),
])
def test_bad_mla_values_are_one_line_each(flags, line):
    world = 2 if "tensor-model" in flags else 1
    with pytest.raises(ConfigError) as error:
        parse_args(MLA + flags.split(), world)
    assert line in str(error.value).replace("q_lora_rank", "q-lora-rank")  # field or flag
