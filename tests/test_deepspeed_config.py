"""--deepspeed-config: DeepSpeed JSON keys map to pretrain_gpt.py flags; conflicts and unsupported
keys are one-line errors naming the key."""
import dataclasses
import json
import os
import re

import pytest
import torch

from gigatron.training.config.arguments import build_run_config, parse_args, parse_flags
from gigatron.training.config.deepspeed.pretrain import apply_deepspeed_config

MODEL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--train-iters 10 --mock-data --vocab-size 100")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_config(tmp_path, ds, extra="--lr 1e-3", world=1):
    """parse_args of MODEL + extra flags + --deepspeed-config holding `ds`."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return parse_args(f"{MODEL} {extra} --deepspeed-config {path}".split(), world)


def apply(ds, argv=""):
    """The pure mapping on flags parsed from argv (explicit = the flags named in argv)."""
    flags = parse_flags((MODEL + " " + argv).split())
    explicit = {a.lstrip("-").replace("-", "_") for a in argv.split() if a.startswith("--")}
    return apply_deepspeed_config(ds, flags, explicit)


def test_batch_logging_and_clipping_keys_map_to_flags():
    f = apply({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
               "gradient_accumulation_steps": 2, "steps_per_print": 7,
               "gradient_clipping": 0.5, "wall_clock_breakdown": True})
    assert (f.global_batch_size, f.micro_batch_size, f.gradient_accumulation_steps) == (32, 4, 2)
    assert (f.log_interval, f.clip_grad, f.timing_log_level) == (7, 0.5, 1)
    assert apply({"wall_clock_breakdown": False}).timing_log_level == 0


def test_zero_section_maps_to_zero_flags_and_config(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2,
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e7, "overlap_comm": False,
                                "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    f = apply(ds)
    assert (f.zero_stage, f.ddp_bucket_size, f.overlap_comm, f.optimizer_cpu_offload) == \
        (2, 50_000_000, False, True)
    z = with_config(tmp_path, ds, world=2).zero
    assert (z.zero_stage, z.reduce_bucket_size, z.overlap_comm, z.offload_optimizer) == \
        (2, 50_000_000, False, "cpu")


def test_fp16_section_maps_to_loss_scaling(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2,
          "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                   "loss_scale_window": 500, "hysteresis": 3, "consecutive_hysteresis": True,
                   "min_loss_scale": 0.25}}
    cfg = with_config(tmp_path, ds)
    z = cfg.zero
    assert cfg.model.params_dtype == torch.float16 and z.loss_scale == 0.0  # 0 = dynamic
    assert (z.initial_scale_power, z.loss_scale_window, z.hysteresis) == (12, 500, 3)
    assert z.consecutive_hysteresis and z.min_loss_scale == 0.25
    assert apply({"fp16": {"enabled": True, "loss_scale": 128}}).loss_scale == 128.0


def test_fp16_disabled_ignores_loss_scaling_and_bf16_enables_bf16():
    f = apply({"fp16": {"enabled": False, "loss_scale": 128, "hysteresis": 5},
               "bf16": {"enabled": True}})
    assert not f.fp16 and f.bf16 and f.loss_scale is None and f.hysteresis == 2


@pytest.mark.parametrize("kind, flag", [("Adam", "adam"), ("AdamW", "adam"), ("adamw", "adam"),
                                        ("SGD", "sgd")])
def test_optimizer_types_map_to_megatron_optimizer(tmp_path, kind, flag):
    # DeepSpeed's "Adam" has adam_w_mode=True by default: both types are AdamW here
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": kind, "params": {
        "lr": 3e-4, "weight_decay": 0.1, **({"momentum": 0.5} if flag == "sgd" else
                                            {"betas": [0.8, 0.95], "eps": 1e-6})}}}
    assert apply(ds).optimizer == flag
    z = with_config(tmp_path, ds, extra="").zero
    assert z.optimizer == ("sgd" if flag == "sgd" else "adamw")
    assert (z.lr, z.weight_decay) == (3e-4, 0.1)
    if flag == "sgd":
        assert z.sgd_momentum == 0.5
    else:
        assert (z.adam_beta1, z.adam_beta2, z.adam_eps) == (0.8, 0.95, 1e-6)


def test_json_values_fill_flags_and_equal_explicit_flags_agree():
    f = apply({"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1},
              "--micro-batch-size 4 --clip-grad 1.0")
    assert f.micro_batch_size == 4 and f.clip_grad == 1.0


def test_json_config_gives_the_same_run_config_as_the_equivalent_flags(tmp_path):
    ds = json.load(open(os.path.join(ROOT, "examples", "ds_config_zero2.json")))
    ds["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    from_json = with_config(tmp_path, ds, extra="", world=8)
    flags = parse_flags(f"{MODEL} --global-batch-size 256 --micro-batch-size 4 --clip-grad 1.0 "
                        "--log-interval 10 --timing-log-level 0 --bf16 --optimizer adam "
                        "--lr 6e-4 --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-8 "
                        "--weight-decay 0.1 --zero-stage 2 --ddp-bucket-size 50000000 "
                        "--optimizer-cpu-offload".split())
    from_flags = build_run_config(flags, 8)
    assert from_json.train.num_microbatches == 8
    resolved = [f.name for f in dataclasses.fields(from_json) if f.name != "settings"]
    assert [getattr(from_json, f) for f in resolved] == [getattr(from_flags, f) for f in resolved]


@pytest.mark.parametrize("ds, expect", [  # (micro batch, global batch, accumulation) at dp 4
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
      "gradient_accumulation_steps": 2}, (4, 32, 2)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (4, 32, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (4, 32, 2)),
    ({"train_batch_size": 32}, (8, 32, 1))])
def test_batch_sizes_follow_deepspeeds_rule(tmp_path, ds, expect):
    train = with_config(tmp_path, ds, world=4).train
    assert (train.micro_batch_size, train.global_batch_size, train.num_microbatches) == expect


def test_inconsistent_batch_sizes_name_the_three_numbers(tmp_path):
    ds = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
          "gradient_accumulation_steps": 2}
    with pytest.raises(ValueError, match=r"train_batch_size 32 != train_micro_batch_size_per_gpu "
                                         r"4 x gradient_accumulation_steps 2 x data-parallel "
                                         r"size 2 = 16"):
        with_config(tmp_path, ds, world=2)
    assert with_config(tmp_path, ds, world=4).train.num_microbatches == 2
    only_train = with_config(tmp_path, {"train_batch_size": 32}, world=4).train
    assert (only_train.micro_batch_size, only_train.num_microbatches) == (8, 1)


CONFLICTS = [  # (config, explicit flags, message)
    ({"train_batch_size": 32}, "--global-batch-size 16",
     r"--global-batch-size 16 on the command line conflicts with train_batch_size: 32"),
    ({"train_micro_batch_size_per_gpu": 4}, "--micro-batch-size 2",
     r"--micro-batch-size 2 .* conflicts with train_micro_batch_size_per_gpu: 4"),
    ({"gradient_clipping": 0.5}, "--clip-grad 1.0", r"--clip-grad 1.0 .* gradient_clipping: 0.5"),
    ({"steps_per_print": 5}, "--log-interval 10", r"--log-interval 10 .* steps_per_print: 5"),
    ({"wall_clock_breakdown": False}, "--timing-log-level 2",
     r"--timing-log-level 2 .* wall_clock_breakdown: false"),
    ({"fp16": {"enabled": False}}, "--fp16", r"--fp16 on the command line .* fp16.enabled: false"),
    ({"bf16": {"enabled": True}}, "--bf16 --no-progress", None),  # agrees: no error
    ({"fp16": {"enabled": True, "loss_scale": 0}}, "--fp16 --loss-scale 1024",
     r"--loss-scale 1024.0 .* fp16.loss_scale: 0"),
    ({"fp16": {"enabled": True, "initial_scale_power": 12}}, "--fp16 --initial-loss-scale 1024",
     r"--initial-loss-scale 1024.0 .* fp16.initial_scale_power: 12"),
    ({"zero_optimization": {"stage": 2}}, "--zero-stage 1",
     r"--zero-stage 1 .* zero_optimization.stage: 2"),
    ({"zero_optimization": {"reduce_bucket_size": 100}}, "--ddp-bucket-size 50",
     r"--ddp-bucket-size 50 .* zero_optimization.reduce_bucket_size: 100"),
    ({"optimizer": {"type": "SGD"}}, "--optimizer adam", r"--optimizer adam .* optimizer.type: "
                                                        r"\"SGD\""),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}, "--lr 3e-4",
     r"--lr 0.0003 .* optimizer.params.lr: 0.0001"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.95]}}}, "--adam-beta2 0.999",
     r"--adam-beta2 0.999 .* optimizer.params.betas\[1\]: 0.95"),
]


@pytest.mark.parametrize("ds, argv, message", CONFLICTS, ids=[c[1] for c in CONFLICTS])
def test_explicit_flag_disagreeing_with_json_is_an_error_naming_both(ds, argv, message):
    if message is None:
        apply(ds, argv)
        return
    with pytest.raises(ValueError, match=message) as err:
        apply(ds, argv)
    assert "\n" not in str(err.value)


UNSUPPORTED = [
    ({"scheduler": {"type": "WarmupLR"}}, r"scheduler is not supported: use --lr-decay-style"),
    ({"activation_checkpointing": {}}, r"activation_checkpointing .* --recompute-granularity"),
    ({"comms_logger": {"enabled": True}}, r"comms_logger is not supported"),
    ({"bogus_key": 1}, r"bogus_key is not supported: supported keys: bf16, fp16"),
    ({"zero_optimization": {"contiguous_gradients": True}},
     r"zero_optimization.contiguous_gradients is not supported; known keys"),
    ({"zero_optimization": {"stage": 4}}, r"zero_optimization.stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "disk"}}},
     r'offload_optimizer.device must be "cpu", "nvme" or "none", got \'disk\''),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memroy": True}}},
     r"offload_optimizer.pin_memroy is not a key of .* did you mean pin_memory\?"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, r"fp16.auto_cast is not supported"),
    ({"bf16": {"enabled": True, "immediate_grad_update": True}},
     r"bf16.immediate_grad_update is not supported"),
    ({"optimizer": {"type": "Lamb"}}, r"optimizer.type 'Lamb' is not supported: use Adam, AdamW"),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
     r"adam_w_mode false .* not supported"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}},
     r"optimizer.params.max_grad_norm is not supported .* use gradient_clipping"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}},
     r"optimizer.params.betas is not supported for SGD"),
    ({"train_batch_size": "auto"}, r"train_batch_size is \"auto\" \(a HuggingFace"),
    ({"train_micro_batch_size_per_gpu": 2.5}, r"train_micro_batch_size_per_gpu must be an "
                                              r"integer"),
]


@pytest.mark.parametrize("ds, message", UNSUPPORTED, ids=[str(u[0])[:40] for u in UNSUPPORTED])
def test_unsupported_key_is_an_error_naming_it(ds, message):
    with pytest.raises(ValueError, match=message) as err:
        apply(ds)
    assert "\n" not in str(err.value)


def test_underscore_spelling_and_file_errors_name_the_flag(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"steps_per_print": 3}')
    assert parse_flags(f"{MODEL} --deepspeed_config {path}".split()).log_interval == 3
    path.write_text("{not json")
    with pytest.raises(ValueError, match=rf"--deepspeed-config {re.escape(str(path))} is not "
                                         r"valid JSON"):
        parse_flags(f"{MODEL} --deepspeed-config {path}".split())
    with pytest.raises(ValueError, match=r"--deepspeed-config .*missing.json: cannot read"):
        parse_flags(f"{MODEL} --deepspeed-config {tmp_path}/missing.json".split())
    path.write_text('{"scheduler": {}}')
    with pytest.raises(ValueError, match=rf"^--deepspeed-config {re.escape(str(path))}: "
                                         r"scheduler is not supported"):
        parse_flags(f"{MODEL} --deepspeed-config {path}".split())


def test_example_deepspeed_config_is_valid_at_its_world_size():
    path = os.path.join(ROOT, "examples", "ds_config_zero2.json")
    cfg = parse_args(f"--model gpt2-124m --train-iters 100 --mock-data "
                     f"--deepspeed-config {path}".split(), 8)
    assert (cfg.parallel.dp, cfg.train.global_batch_size, cfg.train.micro_batch_size,
            cfg.train.num_microbatches) == (8, 256, 4, 8)
    assert (cfg.zero.zero_stage, cfg.zero.lr, cfg.model.params_dtype) == (2, 6e-4, torch.bfloat16)
    with pytest.raises(ValueError, match=r"train_batch_size 256 != .* data-parallel size 4"):
        parse_args(f"--model gpt2-124m --train-iters 100 --mock-data "
                   f"--deepspeed-config {path}".split(), 4)


def test_keys_spelled_at_what_gigatron_does_are_accepted_others_refused():
    """Real configs spell defaults out ("prescale_gradients": false, fp32 accumulation)."""
    flags = apply({"train_batch_size": 8, "prescale_gradients": False,
                   "gradient_predivide_factor": 1.0, "data_types": {"grad_accum_dtype": "fp32"}})
    assert flags.global_batch_size == 8
    for key, value in (("prescale_gradients", True), ("gradient_predivide_factor", 2.0),
                       ("data_types", {"grad_accum_dtype": "bf16"})):
        with pytest.raises(Exception, match=f"{key} is not supported"):
            apply({"train_batch_size": 8, key: value})


def test_megatron_deepspeed_command_line_batch_and_log_interval_win_with_a_note(tmp_path):
    """Megatron-DeepSpeed's loop sets the engine's batch from --global-batch-size each
    iteration and logs every --log-interval: under --deepspeed those flags win over the JSON
    (its run_deepspeed_example.sh passes 1024 against a JSON of 64); without --deepspeed a
    disagreement stays an error, and the JSON's clipping is never overridden."""
    from gigatron.training.config.features import flag_notes

    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10}
    argv = "--lr 1e-3 --micro-batch-size 2 --global-batch-size 16 --log-interval 1"
    run = with_config(tmp_path, ds, extra=argv + " --deepspeed", world=2)
    assert (run.train.global_batch_size, run.train.num_microbatches) == (16, 4)
    assert run.logging.log_interval == 1
    notes = "\n".join(flag_notes(run.settings, "gloo"))
    assert "--global-batch-size 16 is used, not train_batch_size: 8" in notes
    assert "--log-interval 1 is used, not steps_per_print: 10" in notes
    with pytest.raises(ValueError, match=r"--global-batch-size 16 on the command line "
                                         r"conflicts with train_batch_size: 8"):
        with_config(tmp_path, ds, extra=argv, world=2)
    with pytest.raises(ValueError, match=r"--clip-grad 2.0 on the command line conflicts"):
        with_config(tmp_path, {**ds, "gradient_clipping": 1.0},
                    extra=argv + " --deepspeed --clip-grad 2.0", world=2)


def test_offload_optimizer_is_read_as_gigatron_initialize_reads_it(tmp_path):
    """One reader of the section: nvme offloads to host memory and its tuning keys are
    accepted, each with a banner note; the engine gets the same device."""
    from gigatron.training.config.deepspeed.engine import engine_config
    from gigatron.training.config.features import flag_notes

    ds = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2,
          "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme",
                                "pin_memory": False}}}
    run = with_config(tmp_path, ds, world=2)
    assert run.zero.offload_optimizer == "cpu" == engine_config(ds, 2).zero.offload_optimizer
    notes = [n for n in flag_notes(run.settings, "gloo") if n.startswith("--deepspeed-config")]
    assert [n.split(":")[1].strip().split(" ")[0] for n in notes] == [
        "zero_optimization.offload_optimizer.nvme_path",
        "zero_optimization.offload_optimizer.pin_memory",
        "zero_optimization.offload_optimizer.device"]
    assert "offloaded to host memory instead (NVMe offload is not implemented)" in notes[2]


def test_save_interval_without_save_is_megatrons_no_save_with_a_note():
    from gigatron.training.config.features import flag_notes

    run = parse_args(f"{MODEL} --lr 1e-3 --micro-batch-size 1 --save-interval 5".split(), 1)
    assert run.checkpoint.save is None
    assert any("--save-interval without --save" in n for n in flag_notes(run.settings, "gloo"))
