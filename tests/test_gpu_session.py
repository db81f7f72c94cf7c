"""bench/gpu_session.sh (issue 44) cannot die on a typo during the scarce GPU minutes: its dry
run on the CPU (GPU_SESSION_DRY=1) checks every step's command (script or module found,
flags parsed by the script's own argparse, the cuda-marked test files collected) and writes
the files that come back; the checker catches a bad flag, a missing script and a missing
test file; collect keeps the result lines of a bench that a time limit stopped before its
JSON."""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_session.sh")
STEPS = ["ceilings", "kernel-build", "cuda-tests", "side-by-side-llama-1b",
         "side-by-side-gpt3-1.3b", "norm-kernels", "offload-capacity", "moe-mixtral",
         "moe-deepseek"]


def _session_module():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import gpu_session
    finally:
        sys.path.pop(0)
    return gpu_session


def test_script_parses_as_bash():
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


def test_dry_run_checks_every_step_of_the_five_items_in_priority_order(tmp_path):
    env = dict(os.environ, GPU_SESSION_DRY="1", OUT=str(tmp_path / "out"),
               GPU_SESSION_WORK=str(tmp_path / "work"))
    proc = subprocess.run(["bash", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    checked = [line.split(":")[0] for line in proc.stdout.splitlines()
               if line.endswith(")") and ": ok (" in line]
    assert checked == STEPS, proc.stdout[-3000:]
    tests, files = re.search(r"pytest: (\d+) tests in (\d+) files", proc.stdout).groups()
    assert int(tests) >= 70 and int(files) >= 10  # every file with cuda-marked tests
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert list(results) == STEPS and all(r["status"] == "checked" for r in results.values())
    assert "tests/test_attention_kinds_cuda.py" in results["cuda-tests"]["command"]
    assert "--model gpt3-1.3b" in results["side-by-side-gpt3-1.3b"]["command"]
    assert "llama-8b" in results["offload-capacity"]["command"]
    assert (tmp_path / "out" / "summary.md").exists() and (tmp_path / "out" / "session.log").exists()


def test_checker_refuses_a_bad_flag_a_missing_script_and_a_missing_test_file(monkeypatch):
    monkeypatch.chdir(ROOT)
    gs = _session_module()
    assert gs.check_command(["python3", "bench/bench_moe.py", "--parts", "train"]) is None
    bad = gs.check_command(["python3", "bench/bench_moe.py", "--train-modelz", "x"])
    assert bad.startswith("exit 2") and "unrecognized arguments" in bad
    wrong_choice = gs.check_command(["python3", "bench/bench_side_by_side.py", "--model", "x"])
    assert "invalid choice" in wrong_choice
    assert "no such script" in gs.check_command(["python3", "bench/bench_nothing.py"])
    assert "no such test file" in gs.check_command(["python3", "-m", "pytest",
                                                    "tests/test_nothing_cuda.py"])
    assert "no module" in gs.check_command(["python3", "-m", "gigatron.no_such_module"])


def test_collect_keeps_result_lines_of_a_bench_stopped_by_its_limit(tmp_path):
    gs = _session_module()
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "side").mkdir(parents=True)
    out.mkdir()
    (work / "steps.tsv").write_text("side\texit 124\t80\tpython3 bench/x.py\n"
                                    "moe\tskipped\t0\tpython3 bench/y.py\n")
    (work / "side.log").write_text('side-by-side result: {"contender": "a", "tokens_per_s": 9}\n'
                                   "| contender | tokens/s |\n")
    (work / "side" / "part.json").write_text('{"x": 1}')
    steps = gs.collect(str(work), str(out))
    assert steps["side"]["result_lines"] == [{"contender": "a", "tokens_per_s": 9}]
    assert steps["side"]["part.json"] == {"x": 1} and steps["moe"]["status"] == "skipped"
    summary = (out / "summary.md").read_text()
    assert "| side | exit 124 | 80 |" in summary and "| contender | tokens/s |" in summary
