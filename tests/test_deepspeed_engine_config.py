"""gigatron.initialize's config reader: a DeepSpeed JSON read with DeepSpeed's meanings and
defaults (not pretrain_gpt.py's), "auto" filled as Hugging Face fills it, every problem
reported at once, and real configs from DeepSpeed's and Hugging Face's repositories accepted."""
import argparse
import base64
import glob
import json
import os
import sys
import types

import pytest
import torch

from gigatron.training.config.arguments import build_run_config, parse_flags
from gigatron.training.config.deepspeed.batch import deepspeed_batch_triple
from gigatron.training.config.deepspeed.engine import engine_config
from gigatron.training.config.deepspeed.pretrain import apply_deepspeed_config
from gigatron.training.config.table import deepspeed_default, row_of, table
from gigatron.training.config.deepspeed.optimizer import OPTIMIZER_PARAMS
from gigatron.training.config.validation import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "deepspeed_configs")
MICRO = {"train_micro_batch_size_per_gpu": 2}
MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--train-iters 10 --mock-data --vocab-size 100 --lr 1e-3").split()


def pretrain_run(ds, world=1):
    """pretrain_gpt.py's RunConfig of MODEL's flags with --deepspeed-config `ds`."""
    return build_run_config(apply_deepspeed_config(ds, parse_flags(MODEL), set()), world)


def problems(ds, world=1, **kw):
    """The problem lines engine_config raises for `ds` (it must raise)."""
    with pytest.raises(ValueError) as err:
        engine_config(ds, world, **kw)
    lines = getattr(err.value, "problems", [str(err.value)])
    assert all("\n" not in line for line in lines), lines
    return lines


def hf_args(**kw):
    """An argparse.Namespace with Hugging Face TrainingArguments' attribute names."""
    base = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2,
                learning_rate=3e-4, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
                weight_decay=0.1, max_grad_norm=0.5, fp16=False, bf16=True, max_steps=100,
                warmup_steps=10)
    return argparse.Namespace(**{**base, **kw})


class HFStyleModel(torch.nn.Module):
    def __init__(self, hidden: int = 64) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(hidden_size=hidden)
        self.linear = torch.nn.Linear(hidden, hidden)


# ---- the batch triple --------------------------------------------------------------------
@pytest.mark.parametrize("train, micro, grad_acc, dp, expected", [
    (32, 4, 2, 4, (32, 4, 2)),  # all three, consistent
    (32, 4, None, 4, (32, 4, 2)),  # accumulation = train // micro // dp
    (32, None, 2, 4, (32, 4, 2)),  # micro = train // dp // accumulation
    (None, 4, 2, 4, (32, 4, 2)),  # train = micro x accumulation x dp
    (32, None, None, 4, (32, 8, 1)),  # train alone: accumulation 1
    (None, 4, None, 4, (16, 4, 1)),  # micro alone: accumulation 1
    (7, 7, None, 1, (7, 7, 1)),
])
def test_any_two_batch_keys_imply_the_third_as_deepspeed_infers_it(train, micro, grad_acc, dp,
                                                                   expected):
    assert deepspeed_batch_triple(train, micro, grad_acc, dp) == expected


@pytest.mark.parametrize("train, micro, grad_acc, dp, message", [
    (32, 4, 2, 2, "train_batch_size 32 != train_micro_batch_size_per_gpu 4 x "
                  "gradient_accumulation_steps 2 x data-parallel size 2 = 16: make them agree"),
    (30, 4, None, 2, "train_batch_size 30 != train_micro_batch_size_per_gpu 4 x "
                     "gradient_accumulation_steps 3 x data-parallel size 2 = 24 "
                     "(gradient_accumulation_steps inferred as 30 // 4 // 2 = 3)"),
    (4, 8, None, 1, "gradient_accumulation_steps inferred as 4 // 8 // 1 = 0, which must be "
                    ">= 1: make train_batch_size 4 a multiple of train_micro_batch_size_per_gpu "
                    "8 x data-parallel size 1"),
    (4, None, None, 8, "train_micro_batch_size_per_gpu inferred as 4 // 8 // 1 = 0, which must "
                       "be >= 1"),
    (None, None, 4, 2, "give train_batch_size or train_micro_batch_size_per_gpu"),
    (0, 4, 1, 1, "train_batch_size must be >= 1, got 0"),
])
def test_inconsistent_batch_keys_are_one_line_with_the_arithmetic(train, micro, grad_acc, dp,
                                                                  message):
    with pytest.raises(ValueError) as err:
        deepspeed_batch_triple(train, micro, grad_acc, dp)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_batch_uses_the_data_parallel_size_not_the_world_size():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}
    cfg = engine_config(ds, 8, dp_world_size=2)
    assert (cfg.train_batch_size, cfg.gradient_accumulation_steps) == (32, 4)
    ds["gradient_accumulation_steps"] = 2
    assert problems(ds, 8, dp_world_size=2) == [
        "train_batch_size 32 != train_micro_batch_size_per_gpu 4 x gradient_accumulation_steps "
        "2 x data-parallel size 2 = 16: make them agree, or leave one out to be inferred"]
    assert problems({"train_micro_batch_size_per_gpu": 2.5}) == [
        "train_micro_batch_size_per_gpu must be an integer, got 2.5"]


# ---- DeepSpeed's defaults ------------------------------------------------------------------
def test_keys_left_out_get_deepspeeds_defaults_not_pretrain_gpts():
    cfg = engine_config({**MICRO, "optimizer": {"type": "Adam"}}, 1)
    z, o = cfg.zero, cfg.optimizer
    assert (z.clip_grad, o.weight_decay, o.betas, o.eps, o.lr) == (0.0, 0.0, (0.9, 0.999), 1e-8,
                                                                   1e-3)
    assert (cfg.steps_per_print, cfg.precision, cfg.wall_clock_breakdown) == (10, "fp32", False)
    assert (z.zero_stage, z.reduce_bucket_size, z.overlap_comm, z.offload_optimizer) == \
        (0, 500_000_000, False, "none")
    assert (z.loss_scale, z.initial_scale_power, z.loss_scale_window, z.hysteresis,
            z.consecutive_hysteresis, z.min_loss_scale) == (0.0, 16, 1000, 2, False, 1.0)
    assert (cfg.prescale_gradients, cfg.gradient_predivide_factor, z.grad_reduce_dtype) == \
        (False, 1.0, "fp32")
    assert cfg.scheduler is None and cfg.tensorboard_dir is None and cfg.info == []
    assert cfg.activation_checkpointing["partition_activations"] is False
    assert cfg.checkpoint == {"tag_validation": "Warn", "load_universal": False,
                              "use_node_local_storage": False}
    megatron = pretrain_run(MICRO).zero  # pretrain_gpt.py keeps Megatron's defaults
    assert (megatron.clip_grad, megatron.weight_decay) == (1.0, 0.01)


def test_overlap_comm_defaults_on_at_stage_3_only_as_in_deepspeed():
    def overlap(stage):
        return engine_config({**MICRO, "zero_optimization": {"stage": stage}}, 2).zero.overlap_comm
    assert [overlap(s) for s in (0, 1, 2, 3)] == [False, False, False, True]


def test_the_table_documents_the_defaults_the_engine_applies():
    cfg = engine_config({**MICRO, "optimizer": {"type": "SGD"}}, 1)
    engine = {"clip_grad": cfg.zero.clip_grad, "log_interval": cfg.steps_per_print,
              "weight_decay": cfg.optimizer.weight_decay, "sgd_momentum": cfg.optimizer.momentum,
              "lr": OPTIMIZER_PARAMS["adam"]["lr"], "zero_stage": cfg.zero.zero_stage,
              "ddp_bucket_size": cfg.zero.reduce_bucket_size,
              "consecutive_hysteresis": cfg.zero.consecutive_hysteresis}
    for dest, value in engine.items():
        assert deepspeed_default(row_of(dest)) == value, dest
    assert OPTIMIZER_PARAMS["adam"]["weight_decay"] == deepspeed_default(row_of("weight_decay"))
    with open(os.path.join(ROOT, "docs", "FLAGS.md")) as f:
        assert "`gradient_clipping` (DeepSpeed default `0.0`)" in f.read()
    assert all(deepspeed_default(r) == r.default for r in table() if not r.spec.ds)


# ---- precision -----------------------------------------------------------------------------
def test_fp16_section_gives_fp16_and_deepspeeds_loss_scaling():
    cfg = engine_config({**MICRO, "fp16": {
        "enabled": True, "auto_cast": True, "loss_scale": 0, "initial_scale_power": 12,
        "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": True,
        "min_loss_scale": 0.5}}, 1)
    z = cfg.zero
    assert (cfg.precision, cfg.fp16_auto_cast) == ("fp16", True)
    assert (z.loss_scale, z.initial_scale_power, z.loss_scale_window, z.hysteresis,
            z.consecutive_hysteresis, z.min_loss_scale) == (0.0, 12, 500, 3, True, 0.5)
    static = engine_config({**MICRO, "fp16": {"enabled": True, "loss_scale": 128}}, 1).zero
    assert static.loss_scale == 128.0
    off = engine_config({**MICRO, "fp16": {"enabled": False, "hysteresis": 9}}, 1)
    assert (off.precision, off.zero.hysteresis) == ("fp32", 2)  # ignored, as in DeepSpeed


@pytest.mark.parametrize("section", ["bf16", "bfloat16"])
def test_bf16_and_its_legacy_spelling_bfloat16(section):
    assert engine_config({**MICRO, section: {"enabled": True}}, 1).precision == "bf16"


def test_precision_conflicts_are_errors():
    assert problems({**MICRO, "fp16": {"enabled": True}, "bf16": {"enabled": True}}) == [
        "fp16.enabled and bf16.enabled are both true: enable one (DeepSpeed refuses both too)"]
    assert "bf16 and bfloat16 (its legacy spelling) are both given" in problems(
        {**MICRO, "bf16": {"enabled": True}, "bfloat16": {"enabled": False}})[0]


# ---- optimizer and scheduler ---------------------------------------------------------------
@pytest.mark.parametrize("kind, expected", [
    ("Adam", dict(type="adam", lr=1e-3, eps=1e-8, adam_w_mode=True)),
    ("AdamW", dict(type="adamw", lr=1e-3, eps=1e-8, adam_w_mode=True)),
    ("adamw", dict(type="adamw")),
    ("SGD", dict(type="sgd", lr=1e-3, momentum=0.0, nesterov=False)),
    ("Lamb", dict(type="lamb", lr=1e-3, max_coeff=10.0, min_coeff=0.01)),
    ("Adagrad", dict(type="adagrad", lr=1e-2, eps=1e-10, initial_accumulator_value=0.0)),
])
def test_every_optimizer_type_gets_deepspeeds_params_and_defaults(kind, expected):
    spec = engine_config({**MICRO, "optimizer": {"type": kind}}, 1).optimizer
    assert spec.weight_decay == 0.0 and spec.extra == {}
    assert {k: getattr(spec, k) for k in expected} == expected


def test_optimizer_params_are_read_per_type():
    sgd = engine_config({**MICRO, "optimizer": {"type": "SGD", "params": {
        "lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4}}}, 1).optimizer
    assert (sgd.lr, sgd.momentum, sgd.nesterov, sgd.dampening, sgd.weight_decay) == \
        (0.1, 0.9, True, 0.0, 1e-4)
    assert problems({**MICRO, "optimizer": {"type": "SGD", "params": {  # the builder's rule
        "nesterov": True, "dampening": 0.1}}}) == [
        "optimizer.params.nesterov needs momentum > 0 and dampening 0, got momentum 0.0, "
        "dampening 0.1"]
    lamb = engine_config({**MICRO, "optimizer": {"type": "Lamb", "params": {
        "lr": 2e-3, "betas": [0.8, 0.9], "max_coeff": 0.3, "bias_correction": False}}},
        1).optimizer
    assert (lamb.betas, lamb.max_coeff, lamb.extra) == ((0.8, 0.9), 0.3,
                                                        {"bias_correction": False})
    assert problems({**MICRO, "optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}}) \
        == ["optimizer.params.betas is not a parameter of SGD; known: dampening, lr, maximize, "
            "momentum, nesterov, weight_decay"]


def test_adam_w_mode_and_torch_adam_as_deepspeed_reads_them():
    def adam(kind, **params):
        return engine_config({**MICRO, "optimizer": {"type": kind, "params": params}},
                             1).optimizer
    assert adam("Adam", adam_w_mode=False).adam_w_mode is False  # L2 weight decay
    assert adam("AdamW", adam_w_mode=False).adam_w_mode is True  # AdamW always decouples
    assert adam("AdamW", torch_adam=True).weight_decay == 0.01  # torch.optim.AdamW's default
    assert adam("AdamW", torch_adam=True, weight_decay=0).weight_decay == 0.0
    assert adam("Adam", torch_adam=True, adam_w_mode=False).weight_decay == 0.0
    assert adam("Adam", bias_correction=True).extra == {}  # DeepSpeed's default: not extra


@pytest.mark.parametrize("kind, message", [
    ("OneBitAdam", "optimizer.type 'OneBitAdam' (DeepSpeed's own) is not supported: 1-bit Adam "
                   "compresses the gradient all-reduce (it changes results): use Adam"),
    ("ZeroOneAdam", "use Adam"), ("OneBitLamb", "use Lamb"),
    ("MuAdam", "build mup.MuAdam(model.parameters(), ...) yourself and pass it as "
               "initialize(optimizer=...)"),
    ("Lion", "build a Lion optimizer"),
    ("RMSprop", "optimizer.type 'RMSprop': DeepSpeed builds torch.optim.RMSprop from it; here "
                "build torch.optim.RMSprop(model.parameters(), ...) and pass it as "
                "initialize(optimizer=...)"),
    ("Adamm", "optimizer.type 'Adamm' is not supported: use one of Adam, AdamW, Lamb, SGD, "
              "Adagrad, Muon; did you mean Adam?"),
])
def test_optimizers_not_implemented_name_what_to_use_instead(kind, message):
    lines = problems({**MICRO, "optimizer": {"type": kind}})
    assert len(lines) == 1 and message in lines[0]


def test_no_optimizer_section_means_the_caller_passes_one():
    assert engine_config(MICRO, 1).optimizer is None
    assert problems({**MICRO, "optimizer": "Adam"}) == [
        "optimizer must be a JSON object like {\"type\": ..., \"params\": {...}}, got 'Adam'"]


def test_scheduler_type_and_params_are_carried_and_the_type_checked():
    params = {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
              "total_num_steps": 100}
    spec = engine_config({**MICRO, "scheduler": {"type": "WarmupDecayLR", "params": params}},
                         1).scheduler
    assert (spec.type, spec.params) == ("WarmupDecayLR", params)
    assert problems({**MICRO, "scheduler": {"type": "WarmupLr"}}) == [
        "scheduler.type 'WarmupLr' is not supported: use one of WarmupLR, WarmupDecayLR, "
        "WarmupCosineLR, OneCycle, LRRangeTest; did you mean WarmupLR?"]
    assert "initialize(lr_scheduler=...)" in problems(
        {**MICRO, "scheduler": {"type": "StepLR"}})[0]


def test_scheduler_params_are_checked_against_the_schedules():
    lines = problems({**MICRO, "scheduler": {"type": "WarmupDecayLR", "params": {
        "warmup_num_step": 10}}})
    assert any("scheduler.params.warmup_num_step is not a parameter of WarmupDecayLR" in line
               and "did you mean warmup_num_steps?" in line for line in lines), lines
    assert "scheduler.params.total_num_steps is required by WarmupDecayLR" in lines


# ---- ZeRO, legacy spellings, info lines ----------------------------------------------------
def test_zero_section_and_communication_dtype_fill_zero_config():
    cfg = engine_config({**MICRO, "communication_data_type": "BF16", "zero_optimization": {
        "stage": 2, "reduce_bucket_size": 2e8, "overlap_comm": True,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "stage3_prefetch_bucket_size": 0}}, 2)
    z = cfg.zero
    assert (z.zero_stage, z.reduce_bucket_size, z.overlap_comm, z.offload_optimizer,
            z.grad_reduce_dtype, z.stage3_prefetch) == (2, 200_000_000, True, "cpu", "bf16",
                                                         False)
    assert problems({**MICRO, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}) == [
        "zero_optimization.offload_optimizer.device needs a sharded optimizer (the offloaded "
        "state is the sharded optimizer state): set zero_optimization.stage to 1, 2 or 3"]


def test_deepspeeds_legacy_zero_spellings_keep_their_meaning():
    assert engine_config({**MICRO, "zero_optimization": True}, 2).zero.zero_stage == 1
    cfg = engine_config({**MICRO, "zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True,
        "stage3_gather_fp16_weights_on_model_save": True}}, 2)
    assert cfg.zero.offload_optimizer == "cpu"
    assert any(line.startswith("zero_optimization.offload_param.device cpu: accepted")
               for line in cfg.info)
    assert any(line.startswith("zero_optimization.stage3_gather_fp16_weights_on_model_save: "
                               "accepted, no effect here") for line in cfg.info)
    assert engine_config({**MICRO, "zero_optimization": {"cpu_offload": False}},
                         1).zero.offload_optimizer == "none"


def test_speed_only_keys_are_accepted_with_one_info_line_each():
    cfg = engine_config({**MICRO, "flops_profiler": {"enabled": True}, "comms_logger": {
        "enabled": False}, "zero_optimization": {"stage": 2, "contiguous_gradients": True,
                                                 "reduce_scatter": True},
        "optimizer": {"type": "AdamW", "params": {"foreach": True}}}, 2)
    named = [line.split(":")[0] for line in cfg.info]
    assert named == ["flops_profiler", "zero_optimization.contiguous_gradients",
                     "zero_optimization.reduce_scatter", "optimizer.params.foreach"]
    assert all("accepted, no effect here" in line for line in cfg.info)


@pytest.mark.parametrize("ds, message", [
    ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op 'sum' is not supported "
                                       "(gradients are averaged over data-parallel ranks): "
                                       "drop it or set it to 'mean'"),
    ({"amp": {"enabled": True}}, 'amp.enabled true is not supported: NVIDIA Apex AMP is not '
                                 'supported: use "fp16" or "bf16"'),
    ({"zero_optimization": {"zero_quantized_gradients": True}},
     "zero_optimization.zero_quantized_gradients True is not supported (ZeRO++ quantized"),
    ({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "bf16"},
     "data_types.grad_accum_dtype 'fp32' and communication_data_type 'bf16' differ: gradients "
     "accumulate in the dtype they are reduced in here; give one of them"),
    ({"pipeline": {"stages": 2}}, "pipeline is not supported: pipeline settings are gigatron.pipe.PipelineModule arguments"),
    ({"checkpoint": {"tag_validation": "Sometimes"}}, "checkpoint.tag_validation must be one "
                                                      "of Ignore, Warn, Fail, got 'Sometimes'"),
])
def test_keys_that_would_change_results_are_errors_naming_the_fix(ds, message):
    lines = problems({**MICRO, **ds})
    assert len(lines) == 1 and message in lines[0], lines


def test_the_same_keys_at_deepspeeds_defaults_are_accepted():
    cfg = engine_config({**MICRO, "gradient_allreduce_op": "mean", "amp": {"enabled": False},
                         "data_types": {"grad_accum_dtype": "fp32"}, "sparse_gradients": False,
                         "checkpoint": {"tag_validation": "fail", "load_universal": True},
                         "activation_checkpointing": {"partition_activations": True,
                                                      "number_checkpoints": 4}}, 1)
    assert cfg.checkpoint["tag_validation"] == "Fail"
    assert cfg.activation_checkpointing["partition_activations"] is True
    assert cfg.activation_checkpointing["number_checkpoints"] == 4
    assert [line.split(":")[0] for line in cfg.info] == ["checkpoint.load_universal"]


def test_monitors_tensorboard_csv_and_wandb(monkeypatch):
    cfg = engine_config({**MICRO, "tensorboard": {"enabled": True, "output_path": "runs",
                                                  "job_name": "a"},
                         "csv_monitor": {"enabled": True}, "wandb": {"enabled": False}}, 1)
    assert (cfg.tensorboard_dir, cfg.csv_dir, cfg.wandb_project) == (
        os.path.join("runs", "a"), "DeepSpeedJobName", None)
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    cfg = engine_config({**MICRO, "wandb": {"enabled": True, "team": "t", "group": "g"}}, 1)
    assert (cfg.wandb_project, cfg.wandb_team, cfg.wandb_group) == ("deepspeed", "t", "g")
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    assert problems({**MICRO, "wandb": {"enabled": True}})[0].startswith(
        "wandb.enabled is true but `import wandb` fails (ModuleNotFoundError")


# ---- "auto" --------------------------------------------------------------------------------
def test_auto_values_are_filled_from_args_and_the_model_as_hugging_face_does():
    path = os.path.join(DATA, "hf_ds_config_zero2.json")
    cfg = engine_config(path, 2, model=HFStyleModel(64), args=hf_args())
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu,
            cfg.gradient_accumulation_steps) == (16, 4, 2)
    o = cfg.optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay, cfg.zero.clip_grad, cfg.precision) == \
        (3e-4, (0.8, 0.95), 1e-6, 0.1, 0.5, "bf16")
    assert cfg.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                    "warmup_num_steps": 10}
    assert "auto" not in json.dumps(cfg.resolved) and cfg.resolved["train_batch_size"] == 16
    z3 = engine_config(os.path.join(DATA, "hf_ds_config_zero3.json"), 2, model=HFStyleModel(64),
                       args=hf_args(fp16=True, bf16=False)).resolved["zero_optimization"]
    assert (z3["reduce_bucket_size"], z3["stage3_prefetch_bucket_size"],
            z3["stage3_param_persistence_threshold"]) == (64 * 64, int(0.9 * 64 * 64), 640)


def test_auto_without_args_takes_the_documented_fallbacks_with_an_info_line():
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto",
          "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}
    original = json.dumps(ds)
    cfg = engine_config(ds, 4)
    assert json.dumps(ds) == original  # the caller's dict is not changed
    assert (cfg.train_micro_batch_size_per_gpu, cfg.resolved["train_micro_batch_size_per_gpu"]) \
        == (8, 8)  # inferred from train_batch_size, as DeepSpeed infers a missing one
    assert (cfg.zero.clip_grad, cfg.optimizer.lr, cfg.zero.reduce_bucket_size) == \
        (1.0, 5e-5, 500_000_000)
    assert [line.split(" ")[0] for line in cfg.info] == [
        "gradient_clipping", "optimizer.params.lr", "zero_optimization.reduce_bucket_size"]
    assert "TrainingArguments.max_grad_norm default" in cfg.info[0]
    warmup = engine_config({**MICRO, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
                            "scheduler": {"type": "WarmupLR", "params": {
                                "warmup_max_lr": "auto"}}}, 1)
    assert warmup.scheduler.params == {"warmup_max_lr": 0.01}  # the optimizer's lr


def test_auto_that_nothing_can_fill_is_an_error_naming_the_key():
    lines = problems({**MICRO, "zero_optimization": {"sub_group_size": "auto"}, "scheduler": {
        "type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}}})
    assert lines == [
        'zero_optimization.sub_group_size is "auto", which neither Hugging Face\'s Trainer nor '
        "accelerate fills: give a value",
        'scheduler.params.total_num_steps is "auto" (Hugging Face fills it with the number of '
        "training steps): give the number, or pass args with max_steps"]
    ok = engine_config({**MICRO, "scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": "auto"}}}, 1,
        args=argparse.Namespace(max_steps=50, warmup_ratio=0.1))
    assert ok.scheduler.params == {"total_num_steps": 50, "warmup_num_steps": 5}


# ---- all problems at once, unknown keys, bad files -----------------------------------------
def test_every_problem_is_reported_at_once_one_line_each():
    lines = problems({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4,
                      "gradient_accumulation_steps": 2, "steps_per_prin": 5,
                      "zero_optimization": {"stage": 4, "contiguous_gradient": True},
                      "optimizer": {"type": "OneBitAdam"}, "sparse_attention": {},
                      "fp16": {"enabled": True}, "bf16": {"enabled": True}}, 2)
    expected = ["steps_per_prin is not a DeepSpeed config key: fix or drop it (DeepSpeed would "
                "ignore it silently); did you mean steps_per_print?",
                "zero_optimization.contiguous_gradient is not a key of zero_optimization; did "
                "you mean contiguous_gradients?", "sparse_attention is not supported",
                "zero_optimization.stage must be 0, 1, 2 or 3, got 4",
                "train_batch_size 30 != train_micro_batch_size_per_gpu 4",
                "fp16.enabled and bf16.enabled are both true",
                "optimizer.type 'OneBitAdam' (DeepSpeed's own) is not supported"]
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected):
        assert line.startswith(start), (line, start)


def test_a_file_that_is_not_json_is_one_line_naming_the_file_and_position(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{\n  "train_batch_size": 8,\n  "fp16": {"enabled": true,}\n}')
    with pytest.raises(ValueError) as err:
        engine_config(path, 1)
    assert str(err.value) == (f"DeepSpeed config {path} is not valid JSON: Expecting property "
                              f"name enclosed in double quotes at line 3 column 28")
    with pytest.raises(ValueError, match=r"DeepSpeed config .*missing.json: cannot read it "
                                         r"\(No such file or directory\)$"):
        engine_config(str(tmp_path / "missing.json"), 1)
    path.write_text('{"train_batch_size": 8, "train_batch_size": 16}')
    with pytest.raises(ValueError, match=r"key 'train_batch_size' appears twice"):
        engine_config(path, 1)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"must hold a JSON object \{\.\.\.\}, got a list"):
        engine_config(path, 1)
    path.write_text('{"train_batch_size": 8, "stepz_per_print": 1}')
    assert problems(str(path))[0].startswith(f"DeepSpeed config {path}: stepz_per_print is not")


def test_deepspeeds_base64_config_string_is_accepted():
    text = base64.urlsafe_b64encode(json.dumps({"train_batch_size": 8}).encode()).decode()
    assert engine_config(text, 2).train_micro_batch_size_per_gpu == 4


# ---- real configs ----------------------------------------------------------------------------
REAL = sorted(glob.glob(os.path.join(DATA, "*.json")))


def test_the_real_configs_are_present_and_listed_in_the_readme():
    with open(os.path.join(DATA, "README.md")) as f:
        readme = f.read()
    files = REAL + sorted(glob.glob(os.path.join(DATA, "refused", "*.json")))
    assert len(REAL) >= 8 and all(os.path.relpath(p, DATA) in readme for p in files)


@pytest.mark.parametrize("path", REAL, ids=[os.path.basename(p) for p in REAL])
def test_real_deepspeed_and_hugging_face_configs_are_accepted(path):
    cfg = engine_config(path, 4)
    with open(path) as f:
        accumulation = json.load(f).get("gradient_accumulation_steps")
    agree = {"gradient_accumulation_steps": accumulation} if isinstance(accumulation, int) else {}
    hf = engine_config(path, 4, model=HFStyleModel(), args=hf_args(**agree))
    assert cfg.train_batch_size == cfg.train_micro_batch_size_per_gpu * \
        cfg.gradient_accumulation_steps * 4
    assert "auto" not in json.dumps(hf.resolved)


REFUSED = {  # real configs with a key that DeepSpeed refuses today, or silently ignores
    "dse_imagenet.json": "cuda_visible_devices is not a DeepSpeed config key",
    "dse_megatron_zero3_stage3.json": "zero_optimization.stage3_param_persitence_threshold is "
                                      "not a key of zero_optimization; did you mean "
                                      "stage3_param_persistence_threshold?",
    "dse_megatron_3d_zero_stage2_max_grad_norm.json": "optimizer.params.max_grad_norm is not "
                                                      "supported (DeepSpeed refuses it too): "
                                                      "use the top-level gradient_clipping",
    "dse_bing_bert_lamb_bsz64k_sparse_attention.json": "sparse_attention is not supported",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_real_configs_with_an_unsupported_key_get_one_line_naming_it(name):
    lines = problems(os.path.join(DATA, "refused", name), 4)
    assert len(lines) == 1 and REFUSED[name] in lines[0], lines


def test_pretrain_gpt_and_initialize_share_the_reader_of_the_table_keys():
    """Same JSON values through the same rows: only keys the JSON leaves out differ."""
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.3, "steps_per_print": 7,
          "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e7},
          "fp16": {"enabled": True, "initial_scale_power": 12, "hysteresis": 3}}
    run, cfg = pretrain_run(ds, 2), engine_config(ds, 2)
    for field in ("zero_stage", "reduce_bucket_size", "clip_grad", "initial_scale_power",
                  "hysteresis"):
        assert getattr(run.zero, field) == getattr(cfg.zero, field), field
    assert run.logging.log_interval == cfg.steps_per_print == 7
    with pytest.raises(ConfigError):
        pretrain_run({"scheduler": {"type": "WarmupLR"}})  # pretrain_gpt.py: a flag
