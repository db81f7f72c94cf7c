"""examples/cpu_quickstart.sh takes its rank count (and layout, iterations) from the
environment; a layout that cannot split the ranks stops before any work, naming the
variables. (The whole script ran with NPROC=2 ITERS=40 when this was written: ~2 minutes.)"""
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "cpu_quickstart.sh")


def test_ranks_that_tp_times_pp_does_not_divide_stop_with_one_line(tmp_path):
    out = tmp_path / "never"
    proc = subprocess.run(["bash", SCRIPT], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "NPROC": "3", "TP": "2", "OUT": str(out)})
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("NPROC=3 is not a multiple of TP x PP = 2 x 1: set NPROC, "
                                   "TP and PP so that TP x PP divides NPROC (e.g. NPROC=4 TP=2 "
                                   "PP=2)")
    assert not out.exists()


def test_the_rank_count_and_iterations_are_read_from_the_environment():
    with open(SCRIPT) as f:
        text = f.read()
    assert "NPROC=${NPROC:-8}" in text and "ITERS=${ITERS:-120}" in text
    assert '--nproc-per-node "$NPROC"' in text and "--nproc-per-node 8" not in text
