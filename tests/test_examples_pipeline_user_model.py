"""examples/pipeline_user_model.py: a user's own transformer pipelined with DeepSpeed's API
(PipelineModule -> gigatron.initialize -> train_batch) trains on CPU, on two torchrun ranks
(two stages) and in one plain process, to the same losses (the initial model and the data
do not depend on the layout)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pipeline_user_model.py")


def _run(cmd, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = re.search(r"done: (\d+) steps, loss ([\d.]+) -> ([\d.]+)", proc.stdout)
    assert match, proc.stdout[-3000:]
    return proc.stdout, int(match.group(1)), float(match.group(2)), float(match.group(3))


@pytest.mark.e2e
def test_two_stages_under_torchrun_train_like_one_process():
    out, steps, first, last = _run([sys.executable, "-m", "torch.distributed.run",
                                    "--standalone", "--nproc-per-node=2", EXAMPLE,
                                    "--steps", "12"])
    assert steps == 12 and last < first - 0.3, out[-2000:]
    assert "stage 1 (pipeline stage 1): layers" in out  # the partition is printed
    _, _, first_single, last_single = _run([sys.executable, EXAMPLE, "--steps", "12"])
    assert (first_single, last_single) == pytest.approx((first, last), abs=2e-4)
