"""examples/deepspeed_style/: a DeepSpeed user's script with only its import changed runs
on CPU -- fp16 + ZeRO-2 + optimizer offload in one process, ZeRO-3 on two ranks."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "deepspeed_style")


def _losses(out: str):
    match = re.search(r"done: (\d+) steps, loss ([\d.]+) -> ([\d.]+)", out)
    assert match, out[-3000:]
    return int(match.group(1)), float(match.group(2)), float(match.group(3))


def _run(cmd, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(cmd, cwd=EXAMPLE, capture_output=True, text=True, timeout=timeout,
                          env={k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_script_differs_from_deepspeed_only_by_its_import():
    text = open(os.path.join(EXAMPLE, "train.py")).read()
    assert "import gigatron as deepspeed" in text
    # the import, and the docstring that says so: no other gigatron name in the script
    assert text.count("gigatron") == 2


def test_fp16_zero2_offload_runs_as_plain_python():
    out = _run([sys.executable, "train.py", "--deepspeed", "--deepspeed_config",
                "ds_config.json", "--epochs", "1"])
    steps, first, last = _losses(out)
    assert steps == 32 and last < first, out[-2000:]


@pytest.mark.e2e
def test_zero3_bf16_runs_on_two_ranks_under_torchrun():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", "train.py", "--deepspeed", "--deepspeed_config",
                "ds_config_zero3.json", "--epochs", "1"])
    steps, first, last = _losses(out)
    assert steps == 32 and last < first, out[-2000:]
