"""bench/bench_side_by_side.py (issue 42) on the CPU toy size: each installed contender trains
the same Llama-style model in its own process and lands in one table with tokens/s, MFU
("n/a" on a CPU), peak memory and a loss of the same order; a contender that cannot run is
a row saying why, not the end of the bench.

torchtitan runs when it is importable or $TORCHTITAN_PATH names a folder holding it
(`pip install --no-deps --target DIR torchtitan==0.3.0 ...`, see the bench's docstring);
otherwise its row is checked to say it is not installed.

The bench's parent (the table) runs in this process through its main(): only the contenders
need processes of their own (a parent process more cost ~2 CPU-s per run).
"""
import json
import math
import os
import sys

import pytest

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def _import_bench():
    sys.path.insert(0, BENCH_DIR)
    try:
        import bench_side_by_side
    finally:
        sys.path.remove(BENCH_DIR)
    return bench_side_by_side


def _bench_main(bench, capsys, *argv):
    """The bench's stdout; each contender still runs in a process of its own (a hung one is
    a failed row after 300 s)."""
    capsys.readouterr()
    assert bench.main(list(argv) + ["--contender-timeout", "300"]) == 0
    return capsys.readouterr().out


def test_toy_run_trains_the_same_model_in_each_installed_framework(tmp_path, capsys):
    bench = _import_bench()
    contenders = ["gigatron eager", "torchtitan", "megatron-core"]
    titan_missing = bench.skip_reason("torchtitan", os.environ.get("TORCHTITAN_PATH"))
    stdout = _bench_main(bench, capsys, "--device", "cpu", "--warmup", "1", "--iters", "2",
                         "--out", str(tmp_path), "--contenders", *contenders)
    report = json.loads((tmp_path / "side_by_side.json").read_text())
    assert report["shape"] == bench.dataclasses.asdict(bench.TOY_SHAPE)  # --toy: CPU default
    by_name = {r["contender"]: r for r in report["results"]}
    assert list(by_name) == contenders
    ran = [by_name["gigatron eager"]]
    if titan_missing:
        assert "not installed" in by_name["torchtitan"]["skipped"]
    else:
        ran.append(by_name["torchtitan"])
    if bench.skip_reason("megatron-core", None) is None:
        ran.append(by_name["megatron-core"])
    for r in ran:
        assert "error" not in r and "skipped" not in r, r
        assert r["tokens_per_s"] > 0 and r["peak_memory_gib"] > 0 and r["mfu"] is None
        assert abs(r["loss"] - math.log(bench.TOY_SHAPE.vocab_size)) < 1.5, r  # same order
    assert len({r["parameters"] for r in ran}) == 1, ran  # the same model everywhere
    assert "| gigatron eager | main |" in stdout and "| n/a |" in stdout
    if titan_missing:
        pytest.skip(f"torchtitan not run: {titan_missing}")


def test_a_contender_whose_flag_has_not_landed_is_skipped_with_the_reason(monkeypatch):
    bench = _import_bench()
    monkeypatch.setattr(bench.contenders, "has_flag", lambda flag: False)
    args = bench.parse(["--device", "cpu"])
    result = bench.run_contender("gigatron compiled", bench.TOY_SHAPE, args)
    assert result == {"contender": "gigatron compiled",
                      "skipped": "--torch-compile is not in gigatron's config table yet"}


def test_gpu_defaults_are_the_1b_llama_and_mfu_uses_the_peak():
    bench = _import_bench()
    args = bench.parse(["--device", "cuda", "--peak-tflops", "1000"])
    assert not args.toy and (args.warmup, args.iters) == (3, 10)
    shape = bench.shape_of(args)
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads,
            shape.num_query_groups, shape.ffn_hidden_size, shape.vocab_size,
            shape.seq_length) == (16, 2048, 16, 8, 8192, 32000, 2048)
    results = [dict(contender="a", version="main", parameters=1, step_s=1.0,
                    tokens_per_s=1e4, peak_memory_gib=2.0, loss=10.0),
               dict(contender="b", error="exit 1: out of memory")]
    bench.add_mfu(results, 5e10, bench.mfu_denominator(None, args.peak_tflops))
    assert results[0]["mfu"] == pytest.approx(0.5)  # 1e4 tokens/s x 5e10 FLOPs / 1e15
    table = bench.markdown(results)
    assert "| a | main | 10,000 | 50.0% | 2.00 | 10.0000 | 1 |" in table
    assert "| b | failed: exit 1: out of memory |" in table


def test_gpt3_model_trains_gigatron_and_skips_torchtitan_with_the_reason(tmp_path, capsys):
    bench = _import_bench()
    arch = bench.contenders.model_config(bench.GPT_SHAPE)
    assert (arch.normalization, arch.position_embedding_type, arch.num_query_groups) == \
        ("LayerNorm", "learned_absolute", 16)
    assert arch.add_bias_linear and not arch.untie_embeddings_and_output_weights
    _bench_main(bench, capsys, "--device", "cpu", "--model", "gpt3-1.3b", "--warmup", "1",
                "--iters", "1", "--out", str(tmp_path), "--contenders", "gigatron eager",
                "torchtitan")
    report = json.loads((tmp_path / "side_by_side.json").read_text())
    assert report["shape"] == bench.dataclasses.asdict(bench.TOY_GPT_SHAPE)
    eager, titan = report["results"]
    assert eager["tokens_per_s"] > 0 and "error" not in eager, eager
    assert "no GPT-2/3 model" in titan["skipped"]
