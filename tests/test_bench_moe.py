"""bench/bench_moe.py runs end to end on the CPU (--device cpu --tiny) before a GPU sees it:
the grouped and loop expert paths agree, every path is timed, the JSON is written."""
import json
import os
import sys

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_tiny_run_checks_and_times_every_path(tmp_path, capsys):
    sys.path.insert(0, BENCH_DIR)
    try:
        import bench_moe
    finally:
        sys.path.remove(BENCH_DIR)
    assert bench_moe.main(["--device", "cpu", "--tiny", "--iters", "2", "--warmup", "1",
                           "--out", str(tmp_path)]) == 0
    (result,) = json.loads((tmp_path / "bench_moe.json").read_text())["results"]
    assert result["grouped_vs_loop_rel_err"] < 1e-5
    for path in ("grouped", "loop", "dense"):
        assert result[f"{path}_ms"] > 0
    assert "| tiny | 64 | 32 | 48 | 4 | 2 |" in capsys.readouterr().out
