"""A DeepSpeed config's "auto" values get what Hugging Face's Trainer or accelerate would give:
from TrainingArguments-named args, accelerate's environment and defaults, the model's hidden
size; checked against the real transformers and accelerate when they are installed."""
import argparse
import glob
import io
import json
import multiprocessing
import os
import runpy
import subprocess
import sys
import traceback
import types

import pytest
import torch

from gigatron.training.config.deepspeed.auto import auto_paths
from gigatron.training.config.deepspeed.engine import engine_config

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "data", "deepspeed_configs")
ACCELERATE_ZERO3 = os.path.join(DATA, "acc_ds_config_zero3.json")
ACCELERATE_TEMPLATE = os.path.join(DATA, "needs_steps", "acc_zero_stage3_config.json")
SCRIPT = os.path.join(HERE, "hf_auto_fill_script.py")
MICRO = {"train_micro_batch_size_per_gpu": 2}
GATHER = "zero_optimization.stage3_gather_16bit_weights_on_model_save"


class HFStyleModel(torch.nn.Module):
    def __init__(self, hidden: int = 64, config=None) -> None:
        super().__init__()
        self.config = config or types.SimpleNamespace(hidden_size=hidden)
        self.linear = torch.nn.Linear(hidden, hidden)


@pytest.fixture(autouse=True)
def no_accelerate_environment(monkeypatch):
    """`accelerate launch` variables of the machine must not leak into the expectations."""
    for name in list(os.environ):
        if name.startswith("ACCELERATE_"):
            monkeypatch.delenv(name)


def get(ds, path):
    node = ds
    for part in path.split("."):
        node = node[part]
    return node


def load(path):
    with open(path) as f:
        return json.load(f)


# ---- accelerate's ZeRO-3 config ----------------------------------------------------------------
def test_accelerates_zero3_config_gets_accelerates_values_without_args():
    cfg = engine_config(ACCELERATE_ZERO3, 2, model=HFStyleModel(64))
    r = cfg.resolved
    assert get(r, GATHER) is False  # accelerate's zero3_save_16bit_model default
    assert (r["fp16"]["enabled"], r["bf16"]["enabled"], r["gradient_clipping"]) == \
        (False, False, 1.0)
    assert r["optimizer"]["params"] == {"lr": 5e-5, "weight_decay": 0.0, "torch_adam": True,
                                        "adam_w_mode": True}
    assert r["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 5e-5,
                                        "warmup_num_steps": 1}
    z = r["zero_optimization"]
    assert (z["reduce_bucket_size"], z["stage3_prefetch_bucket_size"],
            z["stage3_param_persistence_threshold"]) == (4096, 3686, 640)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.zero.zero_stage,
            cfg.precision) == (16, 8, 3, "fp32")
    assert any(line.startswith(f'{GATHER} "auto" -> False (accelerate\'s default; '
                               f"ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL is not set)")
               for line in cfg.info), cfg.info
    assert "auto" not in json.dumps(r)


def test_accelerate_launch_environment_fills_accelerates_keys(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "0.25")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")
    ds = {**MICRO, "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
          "zero_optimization": {"stage": "auto", GATHER.split(".")[1]: "auto",
                                "offload_optimizer": {"device": "auto"}}}
    cfg = engine_config(ds, 2)
    assert (cfg.zero.zero_stage, cfg.precision, cfg.zero.clip_grad,
            cfg.gradient_accumulation_steps, cfg.zero.offload_optimizer) == (1, "bf16", 0.25, 4,
                                                                            "none")
    assert get(cfg.resolved, GATHER) is True
    assert "zero_optimization.stage \"auto\" -> 1 (accelerate's " \
           "ACCELERATE_DEEPSPEED_ZERO_STAGE=1)" in cfg.info
    # the Trainer fills its keys from args before accelerate sees the config: args win
    args = argparse.Namespace(max_grad_norm=0.5, fp16=True, bf16=False)
    trainer = engine_config(ds, 2, args=args)
    assert (trainer.zero.clip_grad, trainer.precision) == (0.5, "fp16")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "three")
    lines = problems({**MICRO, "zero_optimization": {"stage": "auto"}})
    assert lines == ["zero_optimization.stage is \"auto\" and ACCELERATE_DEEPSPEED_ZERO_STAGE="
                     "'three' does not say its value: fix the variable or give the value"]


def test_accelerates_template_needs_the_number_of_training_steps():
    lines = problems(ACCELERATE_TEMPLATE, 2, model=HFStyleModel(64))
    assert len(lines) == 1 and "scheduler.params.total_num_steps is \"auto\"" in lines[0], lines
    args = argparse.Namespace(max_steps=200, warmup_steps=0.05, learning_rate=1e-4)
    cfg = engine_config(ACCELERATE_TEMPLATE, 2, model=HFStyleModel(64), args=args)
    assert cfg.scheduler.params == {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                    "warmup_num_steps": 10, "total_num_steps": 200}
    assert (cfg.precision, get(cfg.resolved, GATHER)) == ("fp16", False)


# ---- the Trainer's rules -----------------------------------------------------------------------
def problems(ds, world=1, **kw):
    with pytest.raises(ValueError) as err:
        engine_config(ds, world, **kw)
    return getattr(err.value, "problems", [str(err.value)])


@pytest.mark.parametrize("args, expected", [
    (argparse.Namespace(warmup_steps=0), 1),  # DeepSpeed >= 0.19.6 refuses 0: both give 1
    (argparse.Namespace(warmup_steps=7), 7),
    (argparse.Namespace(warmup_steps=0.1, max_steps=50), 5),  # transformers 5: a ratio
    (argparse.Namespace(warmup_steps=0, warmup_ratio=0.01, max_steps=50), 1),  # older: ceil
    (None, 1),
])
def test_warmup_num_steps_is_at_least_one_as_both_fill_it(args, expected):
    ds = {**MICRO, "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}}
    assert engine_config(ds, 1, args=args).scheduler.params["warmup_num_steps"] == expected


def test_hidden_size_is_read_where_hugging_face_reads_it():
    ds = {**MICRO, "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    text = types.SimpleNamespace(text_config=types.SimpleNamespace(hidden_size=32))
    sizes = types.SimpleNamespace(hidden_sizes=[16, 48, 32])
    assert engine_config(ds, 1, model=HFStyleModel(8, text)).zero.reduce_bucket_size == 32 * 32
    assert engine_config(ds, 1, model=HFStyleModel(8, sizes)).zero.reduce_bucket_size == 48 * 48


def test_auto_that_neither_fills_is_an_error_naming_the_key():
    lines = problems({**MICRO, "steps_per_print": "auto",
                      "zero_optimization": {"stage": 2, "sub_group_size": "auto"}})
    assert lines == [f'{key} is "auto", which neither Hugging Face\'s Trainer nor accelerate '
                     f"fills: give a value" for key in ("steps_per_print",
                                                        "zero_optimization.sub_group_size")]


# ---- against the real libraries ----------------------------------------------------------------
def _run(mode, cases, timeout):
    """The script's FILLED output, run in a process forked from this one (measured, the
    transformers and accelerate modes: 3.0 and 6.6 CPU-s as new interpreters, mostly imports
    this process has made already; forked 1.7 and 2.8), or where a GPU is, as a new
    interpreter: a forked child cannot use CUDA once this process has."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    if torch.cuda.is_available():
        env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_")}
        out = subprocess.run([sys.executable, SCRIPT, mode], input=json.dumps(cases), env=env,
                             capture_output=True, text=True, timeout=timeout, cwd=HERE)
        assert out.returncode == 0, out.stderr[-3000:]
        stdout = out.stdout
    else:  # no_accelerate_environment has taken the ACCELERATE_ variables out already
        stdout = _forked(_run_script_here, mode, cases, timeout=timeout)
    filled = [line for line in stdout.splitlines() if line.startswith("FILLED ")]
    assert filled, stdout[-3000:]
    return json.loads(filled[-1][len("FILLED "):])


def _run_script_here(mode, cases):
    """`python SCRIPT mode < cases`, run in this process: its stdout."""
    os.chdir(HERE)
    sys.argv, sys.stdin, sys.stdout = [SCRIPT, mode], io.StringIO(json.dumps(cases)), io.StringIO()
    runpy.run_path(SCRIPT, run_name="__main__")
    return sys.stdout.getvalue()


def _forked(fn, *args, timeout):
    """fn(*args) in a child forked from this process; the test fails with the child's
    traceback if it raises, its exit code if it dies, and kills it if it hangs."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_send_result, args=(send, fn, args))
    child.start()
    send.close()  # so that the child's death reads as the pipe's end
    try:
        if not receive.poll(timeout):
            pytest.fail(f"{fn.__name__}{args[:1]} did not finish within {timeout} s")
        status, value = receive.recv()
    except EOFError:
        child.join(5)
        pytest.fail(f"{fn.__name__}{args[:1]} died with exit code {child.exitcode}")
    finally:
        child.kill()
        child.join()
    assert status == "ok", value
    return value


def _send_result(send, fn, args):
    try:
        send.send(("ok", fn(*args)))
    except BaseException:  # the traceback, for the test's message
        send.send(("error", traceback.format_exc()))


def _trainer_args(ds):
    """TrainingArguments values that agree with the config's fixed (non-"auto") values."""
    fp16 = get(ds, "fp16.enabled") is True if "fp16" in ds else False
    accumulation = ds.get("gradient_accumulation_steps")
    return dict(per_device_train_batch_size=4, learning_rate=3e-4, adam_beta1=0.8,
                adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.1, max_grad_norm=0.5,
                fp16=fp16, bf16=not fp16, fp16_full_eval=False, bf16_full_eval=False,
                max_steps=100, warmup_steps=10,
                gradient_accumulation_steps=accumulation if isinstance(accumulation, int) else 2)


AUTO_CONFIGS = [p for p in sorted(glob.glob(os.path.join(DATA, "*.json"))) + [ACCELERATE_TEMPLATE]
                if "auto" in open(p).read()]


def test_every_auto_is_what_the_trainer_fills():
    cases = [dict(config=p, args=_trainer_args(load(p)), hidden_size=64, world_size=2)
             for p in AUTO_CONFIGS]
    filled = _run("transformers", cases, timeout=300)
    for case, theirs in zip(cases, filled):
        ours = engine_config(case["config"], 2, model=HFStyleModel(64),
                             args=argparse.Namespace(**case["args"])).resolved
        # the Trainer fills every "auto" but accelerate's key (left for accelerate) and the
        # legacy "bfloat16" spelling of its own bf16 test config (gigatron fills it as bf16)
        keys = [k for k in auto_paths(load(case["config"])) if get(theirs, k) != "auto"]
        assert set(auto_paths(load(case["config"]))) - set(keys) <= {GATHER, "bfloat16.enabled"}
        assert {k: get(ours, k) for k in keys} == {k: get(theirs, k) for k in keys}, \
            case["config"]


def test_every_auto_of_accelerates_zero3_config_is_what_accelerate_fills():
    args = dict(per_device_train_batch_size=4, learning_rate=3e-4, weight_decay=0.1,
                max_steps=100, warmup_steps=10)
    theirs = _run("accelerate", dict(config=ACCELERATE_ZERO3, args=args, hidden_size=64,
                                     world_size=1), timeout=500)
    ours = engine_config(ACCELERATE_ZERO3, 1, model=HFStyleModel(64),
                         args=argparse.Namespace(**args)).resolved
    keys = auto_paths(load(ACCELERATE_ZERO3))
    assert GATHER in keys and len(keys) == 14
    assert {k: get(ours, k) for k in keys} == {k: get(theirs, k) for k in keys}
