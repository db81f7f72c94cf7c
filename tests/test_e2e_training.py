"""pretrain_gpt.py's program on real data, on CPU (fp32, dropout 0): the pp=2 layout through
torchrun (the whole program, 2 ranks), and through the same entry (pretrain.main with the same
flags) on forked gloo ranks the one-rank reference, the other layouts, the tp=2 pp=2 dp=2 run
and its stop-and-resume: forked ranks start in well under a second, where each torchrun'd rank
costs ~5 s of CPU to import and start.

Data: a real .bin/.idx built here from Python standard-library source files (one document
per file, byte-level tokens, eod 256; NullTokenizer with --vocab-size 257: eod is its last id).
Tolerance: every layout logs the single-device run's lm loss at each of 10 iterations within
1e-4 relative (layouts differ only in the order of floating-point reductions). A run stopped
at iteration 6 and resumed to 10 logs the uninterrupted run's losses bit for bit.
"""
import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from multirank import run_on_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "pretrain_gpt.py")
STDLIB_FILES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "shlex.py",
                "fnmatch.py", "glob.py", "bisect.py", "heapq.py", "colorsys.py")
RTOL = 1e-4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A Megatron .bin/.idx of stdlib sources, tokenized as bytes."""
    from gigatron.data.indexed_dataset import IndexedDatasetBuilder

    folder = tmp_path_factory.mktemp("data")
    prefix = str(folder / "stdlib_text_document")
    lib = os.path.dirname(os.__file__)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for name in STDLIB_FILES:
        with open(os.path.join(lib, name), "rb") as f:
            tokens = np.frombuffer(f.read(), dtype=np.uint8).astype(np.int64)
        builder.add_item(np.append(tokens, 256))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def base_flags(prefix: str) -> list:
    return ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
            "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
            "--lr-warmup-iters 2 --lr-decay-style cosine --min-lr 1e-4 --hidden-dropout 0 "
            "--attention-dropout 0 --tokenizer-type NullTokenizer --vocab-size 257 "
            "--split 90,10,0 --log-interval 1 --eval-interval 5 --eval-iters 1 "
            "--no-progress --make-vocab-size-divisible-by 8").split() + ["--data-path", prefix]


def launch(ranks: int, flags: list, timeout: int = 240) -> str:
    """torchrun the program; a hang fails within `timeout` s and kills every worker rank."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", PROGRAM] + flags
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    # its own session, so a timeout can kill torchrun AND the ranks it started
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun did not finish within {timeout} s (a rank hung?):\n"
                    f"{out[-2000:]}{err[-4000:]}")
    assert proc.returncode == 0, out[-3000:] + err[-5000:]
    return out


def train_losses(metrics_file: str) -> dict:
    with open(metrics_file) as f:
        records = [json.loads(line) for line in f]
    return {r["iteration"]: r["lm loss"] for r in records if r["type"] == "train"}


def layout_flags(tp: int, pp: int, zero: int) -> list:
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--zero-stage", str(zero)]


def _program(rank: int, world: int, argv: list) -> int:
    """The program's entry on this forked rank (it leaves the process group at its end)."""
    from gigatron.training.run import pretrain

    return pretrain.main(argv)


def run_forked(ranks: int, flags: list, timeout: int = 240) -> None:
    """pretrain.main(flags) on `ranks` forked gloo ranks; a rank's error fails the test."""
    assert run_on_ranks(_program, ranks, flags, timeout=timeout) == [0] * ranks


def eval_iterations(metrics_file: str) -> list:
    with open(metrics_file) as f:
        records = [json.loads(line) for line in f]
    return [r["iteration"] for r in records if r["type"] == "eval" and r["split"] == "valid"]


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    metrics = str(out / "metrics.jsonl")
    run_forked(1, base_flags(corpus) + layout_flags(1, 1, 0) + ["--metrics-file", metrics])
    losses = train_losses(metrics)
    assert sorted(losses) == list(range(1, 11))
    assert losses[10] < losses[1] - 0.25, losses  # it learns: bytes of code are predictable
    assert eval_iterations(metrics) == [5, 10]
    return losses


# (tp, pp, dp, zero stage): every layout of the issue, and every zero stage where it really
# shards, i.e. with dp = 2 (stage 3 needs pp = 1: ZeRO refuses it under pipelining).
LAYOUTS = [(2, 1, 1, 0), (1, 2, 1, 0), (1, 1, 2, 0), (1, 1, 2, 1), (1, 1, 2, 3), (2, 2, 2, 2)]
FULL_3D = LAYOUTS[-1]


WHOLE_PROGRAM = LAYOUTS[1]  # pp=2: run through torchrun, the program as a user starts it


@pytest.fixture(scope="module")
def full_3d_run(corpus, tmp_path_factory):
    """The uninterrupted tp=2 pp=2 dp=2 run: compared with one device and with a resume."""
    metrics = str(tmp_path_factory.mktemp("full3d") / "metrics.jsonl")
    tp, pp, dp, zero = FULL_3D
    run_forked(8, base_flags(corpus) + layout_flags(tp, pp, zero) + ["--metrics-file", metrics])
    return metrics


@pytest.mark.e2e
@pytest.mark.parametrize("tp,pp,dp,zero", LAYOUTS,
                         ids=[f"tp{t}-pp{p}-dp{d}-zero{z}" for t, p, d, z in LAYOUTS])
def test_layout_logs_single_device_losses(corpus, reference, full_3d_run, tmp_path, tp, pp, dp,
                                          zero):
    metrics = full_3d_run
    if (tp, pp, dp, zero) != FULL_3D:
        metrics = str(tmp_path / "metrics.jsonl")
        flags = base_flags(corpus) + layout_flags(tp, pp, zero) + ["--metrics-file", metrics]
        if (tp, pp, dp, zero) == WHOLE_PROGRAM:
            launch(tp * pp * dp, flags)
        else:
            run_forked(tp * pp * dp, flags)
    losses = train_losses(metrics)
    assert sorted(losses) == list(range(1, 11))
    for it in range(1, 11):
        assert losses[it] == pytest.approx(reference[it], rel=RTOL), (it, losses, reference)


@pytest.mark.e2e
def test_stop_at_6_and_resume_to_10_logs_identical_losses(corpus, full_3d_run, tmp_path, capfd):
    # the stop, the resume and the uninterrupted run they must equal bit for bit run the
    # program's entry on 8 forked ranks (torchrun: test_layout_logs_single_device_losses)
    tp, pp, dp, zero = FULL_3D
    flags = base_flags(corpus) + layout_flags(tp, pp, zero)
    whole = full_3d_run
    ckpt, resumed = str(tmp_path / "ckpt"), str(tmp_path / "resumed.jsonl")
    capfd.readouterr()
    run_forked(8, flags + ["--metrics-file", resumed, "--save", ckpt, "--exit-interval", "6"])
    assert "exiting at iteration 6" in capfd.readouterr().out
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "6"
    run_forked(8, flags + ["--metrics-file", resumed, "--save", ckpt, "--load", ckpt])
    second = capfd.readouterr().out
    assert "loaded checkpoint" in second and "iteration 6" in second
    assert train_losses(resumed) == train_losses(whole)  # exact equality, fp32 on CPU


def test_bad_flag_exits_with_one_line_before_any_work(tmp_path):
    # every other flag is valid: the one problem is the one line (all problems are listed
    # together otherwise, tests/test_megatron_operational.py)
    argv = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 100 "
            "--bogus 1").split()
    proc = subprocess.run([sys.executable, PROGRAM] + argv, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("pretrain_gpt.py: error: unknown flag(s) --bogus 1; "
                                   "see pretrain_gpt.py --help")


def test_parallel_run_without_a_launcher_says_how_to_launch():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "SLURM_", "OMPI_", "PMI_", "PMIX_"))}
    proc = subprocess.run(
        [sys.executable, PROGRAM, "--tensor-model-parallel-size", "2", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--mock-data",
         "--vocab-size", "64"], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith(
        "pretrain_gpt.py: error: this job needs 2 ranks but no launcher variables were found")
    assert "torchrun --nproc-per-node 2" in proc.stderr
