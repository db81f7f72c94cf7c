"""The one config table: argparse, the DeepSpeed reader and docs/FLAGS.md come from it, and a
command line or JSON with several mistakes gets every one of them reported at once."""
import dataclasses
import os
import re

import pytest

from gigatron.parallel.zero import ZeroConfig
from gigatron.training.config.arguments import (ZERO_FLAGS, build_run_config, make_parser, parse_args,
                                         parse_flags)
from gigatron.training.config.run_config import (CheckpointConfig, LoggingConfig, ParallelConfig,
                                      TrainConfig)
from gigatron.training.config.table import flags_markdown, table
from gigatron.training.config.deepspeed.pretrain import apply_deepspeed_config
from gigatron.training.config.megatron.moe import MoESettings
from gigatron.training.config.settings import OptimizerSettings, PrecisionSettings
from gigatron.training.config.megatron.model import MODEL_FIELDS
from gigatron.training.config.validation import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data --vocab-size 100").split()


def test_three_independent_mistakes_are_all_reported():
    with pytest.raises(ConfigError) as err:
        parse_args(BASE + "--fp16 --bf16 --clip-grad -1 --finetune".split(), 1)
    assert len(err.value.problems) == 3, err.value.problems
    text = str(err.value)
    assert text.startswith("3 problems:\n")
    for message in (r"--fp16 and --bf16 are exclusive", r"--clip-grad must be >= 0",
                    r"--finetune needs --load DIR"):
        assert re.search(message, text), text


def test_bad_values_and_unknown_flags_are_all_reported_while_parsing():
    with pytest.raises(ValueError) as err:
        parse_flags(BASE + "--num-layers x --zero-stage 4 --bogus-flag 1".split())
    text = str(err.value)
    for message in (r"unknown flag\(s\) --bogus-flag 1", r"argument --num-layers: invalid int "
                    r"value: 'x'", r"argument --zero-stage: invalid choice: 4"):
        assert re.search(message, text), text


def test_json_with_several_problems_reports_every_key():
    ds = {"scheduler": {}, "zero_optimization": {"stage": 4, "bogus": 1},
          "train_batch_size": "auto", "steps_per_prin": 3}
    with pytest.raises(ConfigError) as err:
        apply_deepspeed_config(ds, parse_flags(BASE), set())
    text = str(err.value)
    for message in (r"scheduler is not supported: use --lr-decay-style",
                    r"zero_optimization.stage must be 0, 1, 2 or 3, got 4",
                    r"zero_optimization.bogus is not supported",
                    r'train_batch_size is "auto"', r"did you mean steps_per_print\?"):
        assert re.search(message, text), text


def test_unknown_json_key_names_the_key_and_the_closest_one():
    with pytest.raises(ValueError, match=r"zero_optimization.stag is not supported; known keys: "
                                         r".*did you mean stage\?"):
        apply_deepspeed_config({"zero_optimization": {"stag": 2}}, parse_flags(BASE), set())


def test_zero_config_reports_all_bad_fields_from_the_shared_rules():
    with pytest.raises(ValueError) as err:
        ZeroConfig(clip_grad=-1.0, hysteresis=0, offload_optimizer="cpu")
    lines = str(err.value).splitlines()
    assert [line.split()[0] for line in lines] == ["offload_optimizer", "clip_grad",
                                                   "hysteresis"]


def test_megatron_defaults_are_kept():
    flags = make_parser().parse_args([])
    assert (flags.weight_decay, flags.adam_beta1, flags.adam_beta2, flags.adam_eps) == \
        (0.01, 0.9, 0.999, 1e-8)
    assert (flags.split, flags.clip_grad, flags.log_interval, flags.eval_interval,
            flags.eval_iters, flags.seed) == ("969,30,1", 1.0, 100, 1000, 100, 1234)
    assert (flags.distributed_timeout_minutes, flags.initial_loss_scale, flags.hysteresis,
            flags.loss_scale_window, flags.min_loss_scale) == (10.0, 2.0 ** 32, 2, 1000, 1.0)
    assert flags.num_workers == 2
    assert (flags.optimizer, flags.lr_decay_style, flags.lr_wsd_decay_style,
            flags.ckpt_format, flags.tensor_model_parallel_size) == \
        ("adam", "linear", "exponential", "torch_dist", 1)
    assert flags.progress is None and flags.zero_stage is None and flags.sgd_momentum == 0.9


def test_help_shows_every_flags_default():
    parser = make_parser()
    for action in parser._actions:
        if action.option_strings and action.dest != "help" and action.const is not False:
            assert "(default: " in action.help, action.option_strings
    text = " ".join(parser.format_help().split())
    assert "--weight-decay WEIGHT_DECAY decoupled weight decay (not on biases and norms) " \
           "(default: 0.01)" in text
    assert "--deepspeed-config PATH, --deepspeed_config PATH" in text


def test_flags_md_is_generated_from_the_table():
    with open(os.path.join(ROOT, "docs", "FLAGS.md")) as f:
        assert f.read() == flags_markdown(), \
            "regenerate: python -m gigatron.training.config.table > docs/FLAGS.md"
    for row in table():
        assert (f"`{row.flag}`" if row.flag else f"`{row.spec.ds}`") in flags_markdown()


# a value different from the default for every flag, and the flags it needs to be valid
SAMPLES = {"window_size": "3,0", "window_attn_skip_freq": "2",
           "model": "gpt2-124m", "position_embedding_type": "rope", "normalization": "RMSNorm",
           "attention_backend": "unfused", "recompute_granularity": "full",
           "recompute_method": "block", "num_query_groups": 2, "hidden_size": 64,
           "ffn_hidden_size": 96, "num_attention_heads": 8, "num_layers": 6,
           "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
           "num_layers_per_virtual_pipeline_stage": 1, "decoder_first_pipeline_num_layers": 2,
           "num_virtual_stages_per_pipeline_rank": 2,
           "data_args_path": os.path.join(ROOT, "tests", "data", "data_args", "data_args.txt"),
           "per_split_data_args_path": os.path.join(ROOT, "tests", "data", "data_args",
                                                    "per_split.json"),
           "decoder_last_pipeline_num_layers": 2, "zero_stage": 2, "optimizer": "sgd",
           "lr_decay_style": "cosine", "lr_wsd_decay_style": "linear", "ckpt_format":
           "safetensors", "tokenizer_type": "NullTokenizer", "timing_log_level": 2,
           "split": "98,1,1", "max_position_embeddings": 32, "min_lr": 1e-4, "initial_loss_scale": 1024.0, "global_batch_size": 8,
           "micro_batch_size": 4, "lr_warmup_fraction": 0.1, "lr_warmup_iters": 0,
           "data_path": ["a"], "train_data_path": ["a"], "valid_data_path": ["b"],
           "test_data_path": ["c"], "deepspeed_config": None, "num_key_value_heads": 2,
           "train_samples": 160, "rampup_batch_size": [8, 8, 32], "kv_channels": 16,
           "distributed_backend": "gloo", "profile_ranks": [0, 1],
           "rope_scaling_high_freq_factor": 16.0,  # above the low factor's default 1
           "moe_layer_freq": "([1]*1+[0]*1)*2", "moe_router_score_function": "sigmoid",
           "moe_router_load_balancing_type": "seq_aux_loss",
           "moe_token_dispatcher_type": "alltoall",
           "hierarchical_context_parallel_sizes": [1, 1]}  # A x P = cp 1
NEEDS = {"recompute_method": "--recompute-granularity full --recompute-num-layers 1",
         "window_attn_skip_freq": "--window-size 3,0 --attention-dropout 0",
         "window_size": "--attention-dropout 0", "glu_linear_offset": "--quick-geglu",
         "activation_func_clamp_value": "--quick-geglu",
         "hierarchical_context_parallel_sizes": "--cp-comm-type a2a+p2p",
         "delay_wgrad_compute": "--pipeline-schedule zb-h1",
         "no_position_embedding": "--position-embedding-type rope",
         "recompute_granularity": "--recompute-method uniform --recompute-num-layers 1",
         "recompute_num_layers": "--recompute-granularity full --recompute-method uniform",
         "num_query_groups": "--group-query-attention",
         "group_query_attention": "--num-query-groups 2", "loss_scale": "--fp16",
         "save_interval": "--save d", "finetune": "--load d", "ckpt_step": "--load d",
         "use_checkpoint_args": "--load d",
         "optimizer_cpu_offload":
         "--zero-stage 1", "sequence_parallel": "--tensor-model-parallel-size 2",
         "num_layers_per_virtual_pipeline_stage": "--pipeline-model-parallel-size 2",
         "num_virtual_stages_per_pipeline_rank": "--pipeline-model-parallel-size 2 "
                                                 "--num-layers 4",
         "pipeline_schedule": "--pipeline-model-parallel-size 2 "
                              "--num-layers-per-virtual-pipeline-stage 1",
         "decoder_first_pipeline_num_layers": "--pipeline-model-parallel-size 2 --num-layers 6",
         "decoder_last_pipeline_num_layers": "--pipeline-model-parallel-size 2 --num-layers 6",
         "num_layers": "--pipeline-model-parallel-size 2", "lr_decay_style":
         "--lr-wsd-decay-iters 2", "lr_wsd_decay_iters": "--lr-decay-style WSD",
         "lr_wsd_decay_style": "--lr-decay-style WSD --lr-wsd-decay-iters 2",
         "lr_warmup_fraction": "--lr-decay-iters 10",
         "lr_decay_samples": "--train-samples 160", "lr_warmup_samples": "--train-samples 160",
         "lr_wsd_decay_samples": "--train-samples 160 --lr-decay-style WSD",
         "rampup_batch_size": "--train-samples 160", "overlap_param_gather":
         "--overlap-grad-reduce --zero-stage 1", "wandb_project": "--wandb-exp-name x",
         "fp8_param_gather": "--fp8-format e4m3 --zero-stage 1",
         "fp8_recipe": "--fp8-format hybrid", "tp_comm_overlap": "--sequence-parallel",
         "non_persistent_save_interval": "--non-persistent-ckpt-type global --save ckpt"}
# MoE flags set MoE layers: a model with experts (and without biases, which they lack)
NEEDS.update({f.name: "--num-experts 6 --disable-bias-linear"
              for f in dataclasses.fields(MoESettings) if f.name != "num_experts"},
             expert_model_parallel_size="--num-experts 6 --disable-bias-linear",
             expert_tensor_parallel_size="--num-experts 6 --disable-bias-linear",
             num_experts="--disable-bias-linear",
             moe_router_group_topk="--num-experts 6 --disable-bias-linear "
                                   "--moe-router-num-groups 3",
             moe_router_enable_expert_bias="--num-experts 6 --disable-bias-linear "
                                           "--moe-router-score-function sigmoid",
             moe_pad_expert_input_to_capacity="--num-experts 6 --disable-bias-linear "
                                              "--moe-expert-capacity-factor 1.0")
# flags accepted by the parser whose values other than the default are refused (one line)
SAMPLES.update(recompute_modules=["mlp", "moe"])  # tests/test_recompute_modules.py
NEEDS.update(recompute_modules="--recompute-granularity selective",
             selective_ac_option="--recompute-granularity selective")
REFUSED = {"use_legacy_models": "--use-legacy-models is not supported",
           "context_parallel_size": "world size 4 is not divisible by tensor x context x "
                                    "pipeline = 1 x 3 x 1 = 3",
           "ds_sequence_parallel_size": "--ds-sequence-parallel-size 3: Megatron-DeepSpeed's "
                                        "Ulysses sequence parallelism is not supported",
           "expert_model_parallel_size": "--expert-model-parallel-size 3 x",
           "expert_tensor_parallel_size": "--expert-tensor-parallel-size 3 = 3 does not divide"}
# flags of BASE a sample-based row replaces
SAMPLE_BASED = ("train_samples", "lr_decay_samples", "lr_warmup_samples",
                "lr_wsd_decay_samples", "rampup_batch_size")
# settings -> where a valid run keeps them (owner field -> RunConfig attribute)
OWNERS = {ParallelConfig: "parallel", TrainConfig: "train", CheckpointConfig: "checkpoint",
          LoggingConfig: "logging"}
DATA_DESTS = ("data_path", "train_data_path", "valid_data_path", "test_data_path",
              "data_args_path", "per_split_data_args_path",
              "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "deepspeed_config",
              "tiktoken_pattern", "tiktoken_num_special_tokens", "tokenizer_special_tokens",
              "tokenizer_hf_no_include_special_tokens",  # tests/test_tokenizer_megatron.py
              "sft")  # conversation files and a chat-template tokenizer: tests/test_sft_data.py


def _sample(row):
    if row.dest == "tokenizer_special_tokens":
        return ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<x>"]
    if row.dest in SAMPLES:
        return SAMPLES[row.dest]
    if row.type is bool:
        return True
    if row.spec.choices:
        return next(c for c in row.spec.choices if c != row.default)
    return {int: 3, float: 0.25, str: "somewhere"}[row.type]


def _argv(row, value):
    if row.type is bool:
        return [row.flag]
    return [row.flag] + ([str(v) for v in value] if row.is_list else [str(value)])


@pytest.mark.parametrize("row", [r for r in table() if r.flag], ids=lambda r: r.flag)
def test_every_flag_parses_and_lands_in_its_config_field(row, monkeypatch):
    # optional packages (tensorboard, wandb) have their own tests: here they are "installed"
    monkeypatch.setattr("gigatron.training.config.features.installed", lambda name: True)
    value = _sample(row)
    if value is None:
        return  # --deepspeed-config has its own tests
    for flag in row.spec.flags:  # aliases too
        assert getattr(parse_flags(BASE + [flag] + _argv(row, value)[1:]), row.dest) == value
    if row.dest in DATA_DESTS:
        return  # needs files on disk: tests/test_arguments.py and test_data_gpt.py
    extra = NEEDS.get(row.dest, "").split()
    base = BASE
    if row.dest in SAMPLE_BASED:
        i = BASE.index("--train-iters")
        base = BASE[:i] + BASE[i + 2:]
    argv = base + ["--global-batch-size", "16"] + extra + _argv(row, value)
    if row.dest in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[row.dest]):
            parse_args(argv, 4)
        return
    run = parse_args(argv, 4)
    if row.owner in OWNERS:
        assert getattr(getattr(run, OWNERS[row.owner]), row.field) == value
    elif row.dest in MODEL_FIELDS:
        assert getattr(run.model, MODEL_FIELDS[row.dest]) == value
    elif row.owner in (PrecisionSettings, OptimizerSettings) and row.dest in \
            ZERO_FLAGS.values() and row.type is not bool:
        field = next(f for f, d in ZERO_FLAGS.items() if d == row.dest)
        expected = {"initial_scale_power": 10, "optimizer": "sgd"}.get(field, value)
        assert getattr(run.zero, field) == expected
    # every setting, also those no resolved config holds, is a typed field of the run
    typed = getattr(getattr(run.settings, row.concern), row.field)
    assert typed == value and isinstance(typed, list if row.is_list else row.type)


# every DeepSpeed key of the table: (JSON holding it, dest, expected flag value)
DS_CASES = {
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 4}, 4),
    "train_batch_size": ({"train_batch_size": 32}, 32),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 2}, 2),
    "steps_per_print": ({"steps_per_print": 7}, 7),
    "wall_clock_breakdown": ({"wall_clock_breakdown": True}, 1),
    "gradient_clipping": ({"gradient_clipping": 0.5}, 0.5),
    "fp16.enabled": ({"fp16": {"enabled": True}}, True),
    "bf16.enabled": ({"bf16": {"enabled": True}}, True),
    "fp16.loss_scale": ({"fp16": {"enabled": True, "loss_scale": 128}}, 128.0),
    "fp16.initial_scale_power": ({"fp16": {"enabled": True, "initial_scale_power": 12}},
                                 4096.0),
    "fp16.min_loss_scale": ({"fp16": {"enabled": True, "min_loss_scale": 0.5}}, 0.5),
    "fp16.loss_scale_window": ({"fp16": {"enabled": True, "loss_scale_window": 50}}, 50),
    "fp16.hysteresis": ({"fp16": {"enabled": True, "hysteresis": 5}}, 5),
    "fp16.consecutive_hysteresis": ({"fp16": {"enabled": True,
                                              "consecutive_hysteresis": True}}, True),
    "zero_optimization.stage": ({"zero_optimization": {"stage": 3}}, 3),
    "zero_optimization.reduce_bucket_size": ({"zero_optimization": {"reduce_bucket_size": 5e7}},
                                             50_000_000),
    "zero_optimization.overlap_comm": ({"zero_optimization": {"overlap_comm": False}}, False),
    "zero_optimization.offload_optimizer": (
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, True),
    "optimizer.type": ({"optimizer": {"type": "SGD"}}, "sgd"),
    "optimizer.params.lr": ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, 0.1),
    "optimizer.params.weight_decay": (
        {"optimizer": {"type": "AdamW", "params": {"weight_decay": 0.2}}}, 0.2),
    "optimizer.params.betas[0]": ({"optimizer": {"type": "Adam", "params": {
        "betas": [0.8, 0.9]}}}, 0.8),
    "optimizer.params.betas[1]": ({"optimizer": {"type": "Adam", "params": {
        "betas": [0.8, 0.9]}}}, 0.9),
    "optimizer.params.eps": ({"optimizer": {"type": "AdamW", "params": {"eps": 1e-6}}}, 1e-6),
    "optimizer.params.momentum": ({"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}},
                                  0.5),
}


def test_every_deepspeed_key_of_the_table_has_a_case():
    assert set(DS_CASES) == {r.spec.ds for r in table() if r.spec.ds}


@pytest.mark.parametrize("key", DS_CASES)
def test_every_deepspeed_key_is_read_into_its_flag(key):
    ds, expected = DS_CASES[key]
    row = next(r for r in table() if r.spec.ds == key)
    flags = apply_deepspeed_config(ds, parse_flags([]), set())
    assert getattr(flags, row.dest) == expected


def test_json_run_matches_flags_run_field_for_field():
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.3,
          "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}
    from_json = build_run_config(apply_deepspeed_config(ds, parse_flags(BASE), set()), 2)
    flags = parse_flags(BASE + "--clip-grad 0.3 --zero-stage 1 --bf16".split())
    from_flags = build_run_config(flags, 2)
    assert from_json.zero == from_flags.zero and from_json.train.micro_batch_size == 2
