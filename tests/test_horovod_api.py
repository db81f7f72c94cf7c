"""gigatron.horovod against Horovod's own test suite's expectations (horovod/horovod
test/parallel/test_torch.py read as the specification): process sets, reducescatter,
alltoall, grouped allgather, join, sparse allreduce, int16, and errors raised on every rank
where Horovod raises them instead of garbage, hangs or aborts. Each check runs on forked
gloo ranks; the whole set also runs as a program under mpirun and gigatron launch."""
import os
import shutil
import subprocess
import sys

import pytest

import horovod_checks
from multirank import free_port, run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "horovod_checks.py")


@pytest.mark.parametrize("check", horovod_checks.CHECKS, ids=lambda f: f.__name__[6:])
def test_on_forked_ranks(check):
    run_on_ranks(check, 3 if "process_sets" in check.__name__ else 2, timeout=90)


def _launch(cmd):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("horovod checks passed, re-init ok") == 2, out[-4000:]


@pytest.mark.e2e
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="OpenMPI's mpirun is not installed")
def test_every_check_and_reinit_under_mpirun():
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    _launch(["mpirun", "-np", "2", *root, "--oversubscribe", "-x", f"MASTER_PORT={free_port()}",
             sys.executable, SCRIPT])


@pytest.mark.e2e
def test_every_check_and_reinit_under_gigatron_launch():
    _launch([sys.executable, "-m", "gigatron", "launch", "-np", "2", "--no_local_rank", SCRIPT])
