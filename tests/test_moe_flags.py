"""Megatron's MoE flags: each lands in its TransformerConfig field with Megatron's meaning,
left out they give Megatron's defaults, --moe-layer-freq reads Megatron's forms without eval,
and every bad value or unbuilt option is one line naming the flag."""
import os

import pytest

from gigatron.training.config.arguments import parse_args, parse_flags
from gigatron.training.config.megatron.catalog import MEGATRON_LM, entries
from gigatron.training.config.megatron.doc import megatron_flag_note
from gigatron.training.config.megatron.moe import MOE_FIELDS, parse_moe_layer_freq
from gigatron.training.config.validation import ConfigError

BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 128 "
        "--disable-bias-linear --swiglu").split()
MOE = BASE + ["--num-experts", "8"]

# flag value(s) -> (TransformerConfig field, value), one case per MoE flag
CASES = [
    ("--num-experts 8", "num_moe_experts", 8),
    ("--moe-ffn-hidden-size 24", "moe_ffn_hidden_size", 24),
    ("--moe-router-topk 3", "moe_router_topk", 3),
    ("--moe-router-score-function sigmoid", "moe_router_score_function", "sigmoid"),
    ("--moe-router-pre-softmax", "moe_router_pre_softmax", True),
    ("--moe-router-topk-scaling-factor 2.5", "moe_router_topk_scaling_factor", 2.5),
    ("--moe-router-num-groups 4 --moe-router-group-topk 2", "moe_router_num_groups", 4),
    ("--moe-router-num-groups 4 --moe-router-group-topk 2", "moe_router_group_topk", 2),
    ("--moe-router-load-balancing-type seq_aux_loss", "moe_router_load_balancing_type",
     "seq_aux_loss"),
    ("--moe-aux-loss-coeff 0.01", "moe_aux_loss_coeff", 0.01),
    ("--moe-z-loss-coeff 0.001", "moe_z_loss_coeff", 0.001),
    ("--moe-router-enable-expert-bias --moe-router-score-function sigmoid",
     "moe_router_enable_expert_bias", True),
    ("--moe-router-bias-update-rate 0.01", "moe_router_bias_update_rate", 0.01),
    ("--moe-expert-capacity-factor 1.5", "moe_expert_capacity_factor", 1.5),
    ("--moe-token-drop-policy position", "moe_token_drop_policy", "position"),
    ("--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity",
     "moe_pad_expert_input_to_capacity", True),
    ("--moe-grouped-gemm", "moe_grouped_gemm", True),
    ("--moe-shared-expert-intermediate-size 64", "moe_shared_expert_intermediate_size", 64),
    ("--moe-layer-freq 2", "moe_layer_freq", 2),
    ("--moe-layer-freq ([1]*1+[0]*1)*2", "moe_layer_freq", [1, 0, 1, 0]),
    ("--moe-token-dispatcher-type alltoall", "moe_token_dispatcher_type", "alltoall"),
    ("--moe-router-dtype fp64", "moe_router_dtype", "fp64"),
    ("--moe-router-force-load-balancing", "moe_router_force_load_balancing", True),
]


@pytest.mark.parametrize("flags, field, value", CASES, ids=[c[0] for c in CASES])
def test_each_moe_flag_sets_its_transformer_config_field(flags, field, value):
    model = parse_args(MOE + flags.split(), 1).model
    assert getattr(model, field) == value


def test_every_moe_flag_has_a_case():
    flags = {case[0].split()[i] for case in CASES for i in range(0, len(case[0].split()))}
    assert {f"--{name.replace('_', '-')}" for name in MOE_FIELDS} <= flags


def test_defaults_left_out_are_megatrons():
    megatron = {names[0]: default for _, names, default in entries(MEGATRON_LM)}
    model = parse_args(MOE, 1).model
    for name, field in MOE_FIELDS.items():
        flag = f"--{name.replace('_', '-')}"
        assert flag in megatron, flag
        expected = megatron[flag]
        if name == "num_experts":
            continue  # given
        if name == "moe_ffn_hidden_size":
            expected = model.ffn_hidden_size  # Megatron-Core: --ffn-hidden-size when None
        elif expected is None and name in ("moe_router_pre_softmax", "moe_grouped_gemm",
                                           "moe_router_enable_expert_bias",
                                           "moe_pad_expert_input_to_capacity",
                                           "moe_router_force_load_balancing"):
            expected = False  # store_true flags
        assert getattr(model, field) == expected, (flag, getattr(model, field), expected)
    assert megatron["--expert-model-parallel-size"] == 1
    flags = parse_flags(MOE)
    assert flags.expert_model_parallel_size == 1 and flags.expert_tensor_parallel_size is None


def test_expert_tensor_parallel_size_defaults_to_tensor_parallel_size():
    run = parse_args(MOE + ["--tensor-model-parallel-size", "2"], 2)
    assert (run.parallel.ep, run.parallel.etp) == (1, 2)
    run = parse_args(MOE + "--tensor-model-parallel-size 2 --expert-tensor-parallel-size 2"
                     .split(), 2)
    assert run.parallel.etp == 2


def test_a_dense_model_is_unchanged_by_the_moe_defaults():
    model = parse_args(BASE, 1).model
    assert model.num_moe_experts is None and model.moe_router_topk == 2


@pytest.mark.parametrize("text, value", [
    ("1", 1), ("3", 3), ("[1,0,1,0]", [1, 0, 1, 0]), ("([1]*3+[0]*1)*2", [1, 1, 1, 0] * 2),
    ("[0]+[1]*3", [0, 1, 1, 1]), ("2*[1,0]", [1, 0, 1, 0]), (" [1] * (2 * 2) ", [1] * 4),
])
def test_moe_layer_freq_reads_megatrons_forms(text, value):
    assert parse_moe_layer_freq(text) == value


@pytest.mark.parametrize("text", [
    "__import__('os').getcwd()", "[1]*10**9", "[1]*1000001", "[2,1]", "[[1]]", "(1,0)",
    "1.5", "", "[1]-[0]", "[1]*[2]", "[1]+1", "x", "[True]",
])
def test_moe_layer_freq_refuses_anything_else_in_one_line(text):
    with pytest.raises(ValueError) as err:
        parse_moe_layer_freq(text)
    assert str(err.value).startswith("--moe-layer-freq") and "\n" not in str(err.value)


def test_moe_layer_freq_runs_no_code(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        parse_args(MOE + ["--moe-layer-freq", f"[open({str(marker)!r}, 'w')] and [1]*4"], 1)
    assert not marker.exists()


@pytest.mark.parametrize("flags, world, line", [
    ("--moe-router-topk 4 --moe-grouped-gemm", 1,
     "--moe-router-topk, --moe-grouped-gemm set MoE layers but the model is dense: add "
     "--num-experts N (or drop them)"),
    ("--moe-aux-loss-coeff 0.1", 1, "--moe-aux-loss-coeff sets MoE layers but the model is "
                                    "dense: add --num-experts N (or drop it)"),
    ("--num-experts 0", 1, "--num-experts must be > 0, got 0"),
    ("--num-experts 8 --moe-router-topk 0", 1, "--moe-router-topk must be > 0, got 0"),
    ("--num-experts 8 --moe-layer-freq [1]+", 1, "--moe-layer-freq '[1]+': give an int N"),
    ("--num-experts 8 --moe-router-load-balancing-type global_aux_loss", 1,
     "--moe-router-load-balancing-type global_aux_loss is not implemented in gigatron"),
    ("--num-experts 8 --moe-router-score-function tanh", 1,
     "argument --moe-router-score-function: invalid choice: 'tanh'"),
    ("--num-experts 8 --expert-model-parallel-size 2 --tensor-model-parallel-size 2", 4,
     "--expert-model-parallel-size 2 / --expert-tensor-parallel-size 2 with "
     "--tensor-model-parallel-size 2 needs --sequence-parallel"),
    ("--num-experts 8 --expert-tensor-parallel-size 1 --tensor-model-parallel-size 2", 4,
     "--expert-model-parallel-size 1 / --expert-tensor-parallel-size 1 with "
     "--tensor-model-parallel-size 2 needs --sequence-parallel"),
    ("--expert-model-parallel-size 2", 4, "--expert-model-parallel-size splits the experts "
                                          "of MoE layers but the model is dense"),
    ("--num-experts 8 --expert-model-parallel-size 0", 1,
     "--expert-model-parallel-size must be > 0, got 0"),
])
def test_bad_moe_values_are_one_line_each(flags, world, line):
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + flags.split(), world)
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0].startswith(line), err.value.problems


@pytest.mark.parametrize("flags, world, line", [
    ("--num-experts 8 --moe-pad-expert-input-to-capacity", 1,
     "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor"),
    ("--num-experts 8 --moe-router-enable-expert-bias", 1,
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    ("--num-experts 8 --moe-router-num-groups 3", 1,
     "--num-experts (8) must be divisible by --moe-router-num-groups (3)"),
    ("--seq-length 17 --tensor-model-parallel-size 2 --sequence-parallel", 2,
     "--seq-length (17) must be divisible by the tensor-parallel size (2) with "
     "--sequence-parallel"),
    ("--hidden-size 30", 1, "--hidden-size (30) must be divisible by --num-attention-heads "
                            "(4): change either, or give --kv-channels"),
    ("--recompute-method uniform", 1, "--recompute-method uniform needs "
                                      "--recompute-granularity full"),
])
def test_the_models_problems_name_the_flags_typed_not_config_fields(flags, world, line):
    """issue 38: `num_moe_experts needs add_bias_linear=False` named config fields."""
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + flags.split(), world)
    assert len(err.value.problems) == 1, err.value.problems
    assert err.value.problems[0].startswith(line), err.value.problems


def test_experts_take_megatrons_default_biases_but_shared_experts_refuse_them():
    biased = [a for a in MOE if a != "--disable-bias-linear"]
    assert parse_args(biased, 1).model.add_bias_linear  # docs/MOE.md's recipe, no zoo
    with pytest.raises(ConfigError) as err:
        parse_args(biased + ["--moe-shared-expert-intermediate-size", "16"], 1)
    assert err.value.problems == ["--moe-shared-expert-intermediate-size needs "
                                  "--disable-bias-linear: shared experts have no biases (as "
                                  "in Megatron-Core)"]


def test_the_no_zoo_recipe_of_docs_moe_md_builds_at_8_ranks():
    """issue 38: the recipe left --disable-bias-linear out and was refused."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "MOE.md")).read()
    command = doc.split("no zoo")[1].split("```")[0].split("\n", 1)[1]
    flags = command.replace("\\\n", " ").split("pretrain_gpt.py", 1)[1].split()
    assert flags[-1] == "..." and "--num-experts" in flags
    run = parse_args(flags[:-1] + "--micro-batch-size 1 --lr 1e-4 --train-iters 1 "
                     "--mock-data --vocab-size 32000".split(), 8)
    assert (run.model.num_moe_experts, run.model.add_bias_linear) == (8, False)


def test_expert_parallel_sizes_must_divide_the_ranks_of_a_stage():
    with pytest.raises(ConfigError) as err:
        parse_args(MOE + ["--expert-model-parallel-size", "3"], 4)
    assert err.value.problems[0] == (
        "--expert-model-parallel-size 3 x --expert-tensor-parallel-size 1 = 3 does not divide "
        "tensor x data parallel = 1 x 4 = 4 (the ranks of a pipeline stage, which the expert "
        "layers split again): change those flags or the launch size")
    assert any("--num-experts 8 is not a multiple of --expert-model-parallel-size 3" in p
               for p in err.value.problems)


@pytest.mark.parametrize("flag, reason", [
    ("--moe-enable-deepep", "DeepEP"),
    ("--moe-router-padding-for-fp8", "FP8/FP4"), ("--moe-enable-routing-replay", "replay"),
    ("--moe-use-upcycling", "upcycling"), ("--moe-use-grouped-tensor", "fused kernel"),
    ("--moe-shared-expert-gate", "mixture-of-experts option is not implemented"),
    ("--moe-expert-parallel-size", "DeepSpeed's MoE layer"),
])
def test_megatron_moe_flags_gigatron_does_not_build_say_why(flag, reason):
    note = megatron_flag_note(flag)
    assert note is not None and reason in note, note
    with pytest.raises(ValueError, match=reason):
        parse_flags(MOE + [flag])


def test_generated_docs_list_the_moe_flags():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "docs", "FLAGS.md")) as f:
        text = f.read()
    assert "## mixture of experts" in text and "`--moe-layer-freq`" in text


def test_a_zoo_moe_model_shows_through_the_flags_left_out():
    zoo = "--model qwen3-30b-a3b --micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data"
    model = parse_args(zoo.split() + ["--moe-aux-loss-coeff", "0.01"], 1).model
    assert (model.num_moe_experts, model.moe_router_topk, model.moe_ffn_hidden_size,
            model.moe_aux_loss_coeff) == (128, 8, 768, 0.01)  # MoE flags need no --num-experts
    assert parse_args(zoo.split() + ["--moe-router-topk", "2"], 1).model.moe_router_topk == 2


def test_a_zoo_moe_model_that_does_not_build_is_not_also_called_dense():
    """Another problem (MTP under cp) leaves no model: expert parallelism is still checked
    against the zoo's experts, so the answer is that one line (`gigatron plan --search`
    listed the spurious 'the model is dense' for every such layout of moonlight-16b-a3b)."""
    zoo = ("--model qwen3-30b-a3b --micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data "
           "--mtp-num-layers 1 --context-parallel-size 2 --expert-model-parallel-size 2")
    with pytest.raises(ConfigError) as error:
        parse_args(zoo.split(), 4)
    assert str(error.value).splitlines()[-1].startswith("--mtp-num-layers with --context")
    assert "dense" not in str(error.value)


def test_the_flex_dispatcher_runs_alltoall_whatever_its_kernel_backend():
    """Megatron's flex dispatcher moves the tokens with DeepEP/HybridEP kernels in the same
    all-to-all exchange; its flags are accepted and the layers run alltoall."""
    run = parse_args(MOE + ["--moe-token-dispatcher-type", "flex",
                            "--moe-flex-dispatcher-backend", "hybridep"], 1)
    assert run.model.moe_token_dispatcher_type == "alltoall"
