"""bench/bench_moe.py runs end to end on the CPU (--device cpu --tiny) before a GPU sees it:
the grouped and loop expert paths agree, every path is timed, the JSON is written; an MoE
layer's all-to-all bytes on forked gloo ranks equal the formula; the MoE GPT and its dense twin
of equal active parameters train through the trainer's step side by side."""
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


def _bench_moe():
    sys.path.insert(0, BENCH_DIR)
    try:
        import bench_moe
    finally:
        sys.path.remove(BENCH_DIR)
    return bench_moe


def test_all_to_all_bytes_of_an_moe_layer_step_equal_the_formula_on_forked_ranks(tmp_path):
    bench_moe = _bench_moe()
    assert bench_moe.exchange_formula(64, 2, 32, 4, 2) == 2 * 2 * 64 * 2 * 32 * 4 // 2
    (row,) = bench_moe.bench_exchange([2], tokens=16, hidden=8, experts=4, topk=2)
    # dispatch + combine, forward + backward: 4 x 16 tokens x top-2 x 8 x 4 B x 1/2
    assert row["formula"] == 2048
    assert row["measured"] == [2048, 2048]


def test_moe_and_dense_gpt_of_equal_active_parameters_train_side_by_side(tmp_path, capsys):
    bench_moe = _bench_moe()
    assert bench_moe.main(["--parts", "train", "--device", "cpu", "--iters", "1",
                           "--warmup", "1", "--train-layers", "2", "--train-hidden", "32",
                           "--train-expert-ffn", "16", "--train-experts", "4",
                           "--train-topk", "2", "--train-micro-batch", "2",
                           "--seq-length", "16", "--out", str(tmp_path)]) == 0
    moe, dense = json.loads((tmp_path / "bench_moe.json").read_text())["train"]
    assert (moe["model"], dense["model"]) == ("moe", "dense")
    # the same active parameters but for each MoE layer's router (E x h)
    assert moe["active_parameters"] - dense["active_parameters"] == 2 * 4 * 32
    # the two inactive experts of each layer: (3 x h x f) each
    assert moe["parameters"] - moe["active_parameters"] == 2 * 2 * 3 * 32 * 16
    assert moe["tokens_per_s"] > 0 and dense["tokens_per_s"] > 0
    assert "| moe | " in capsys.readouterr().out


def test_deepseek_v3_like_family_trains_mla_and_a_shared_expert_beside_its_dense_twin(
        tmp_path, capsys):
    bench_moe = _bench_moe()
    assert bench_moe.main(["--parts", "train", "--device", "cpu", "--iters", "1",
                           "--warmup", "1", "--train-models", "deepseek-v3-like",
                           "--train-layers", "2", "--train-hidden", "32",
                           "--train-expert-ffn", "16", "--train-experts", "4",
                           "--train-topk", "2", "--train-micro-batch", "2",
                           "--seq-length", "16", "--out", str(tmp_path)]) == 0
    moe, dense = json.loads((tmp_path / "bench_moe.json").read_text())["train"]
    assert (moe["family"], moe["model"], dense["model"]) == ("deepseek-v3-like", "moe", "dense")
    # shared expert + top-2 = the dense twin's ffn 3 x f; the MoE layers add their routers
    assert moe["active_parameters"] - dense["active_parameters"] == 2 * 4 * 32
    assert moe["parameters"] - moe["active_parameters"] == 2 * 2 * 3 * 32 * 16
    assert moe["tokens_per_s"] > 0 and dense["tokens_per_s"] > 0
    assert "| deepseek-v3-like | moe | " in capsys.readouterr().out
    flags = bench_moe._train_flags(True, bench_moe.parse_args(["--train-hidden", "2048"]),
                                   "deepseek-v3-like")
    assert flags[flags.index("--num-attention-heads") + 1] == "16"
    assert "--multi-latent-attention" in flags and "--moe-router-enable-expert-bias" in flags
