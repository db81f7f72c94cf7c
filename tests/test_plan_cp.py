"""`gigatron plan` under context parallelism (issue 28).

- The activations it predicts per rank equal what bench/bench_context_parallel.py measures
  (bytes of the storages autograd keeps, forked gloo ranks) for cp 1, 2, 4 under each comm
  type, so the predicted cp1/cp ratio equals the bench's within 15% (measured: exact, byte for
  byte, on the bench's model at 512 tokens).
- Its cp bytes per step equal the bench's formula (which the bench checks against
  parallel/comm's counters), the time is taken on the link the tp x cp ranks span, the ring's
  hops hide behind the attention and the collectives do not; parameters per rank do not change
  with cp and ZeRO shards over dp x cp.
- a2a+p2p (A x P = cp): activations and bytes equal the bench's (--comm-types a2a+p2p, A = 2)
  measured and formula values; the all-to-all takes the tp x A ranks' link, the ring the
  tp x cp ranks' and hides behind the blocks as p2p's does.
- `--search` tries cp (sequence divisible by 2 x cp only); a2a+p2p only when the flags ask
  for it with --hierarchical-context-parallel-sizes A P: every cp > 1 then as A x cp/A.
- Plans without cp are byte-identical to those before cp existed (sha256 of text and JSON
  taken from the pre-cp planner for four layouts, MoE included).
"""
import contextlib
import hashlib
import io
import json
import os
import sys

import pytest

from gigatron.cli import plan as plan_cli
from gigatron.training.plan.cost import NETWORK_EFFICIENCY
from gigatron.training.plan.search import context_sizes

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
BENCH = ("--num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 512 "
         "--max-position-embeddings 512 --vocab-size 256 --make-vocab-size-divisible-by 8 "
         "--position-embedding-type rope --disable-bias-linear --hidden-dropout 0 "
         "--attention-dropout 0 --micro-batch-size 1 --lr 1e-4 --train-iters 1 "
         "--mock-data").split()
SMALL = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
         "--max-position-embeddings 512 --vocab-size 1000 --micro-batch-size 1 "
         "--global-batch-size 16 --bf16 --lr 1e-4 --train-iters 1 --mock-data").split()
CP_SMALL = SMALL + ["--attention-dropout", "0"]  # attention dropout is refused under cp


def _plan_output(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert plan_cli.main(list(argv)) == 0, argv
    return buf.getvalue()


def _plan(argv):
    return json.loads(_plan_output(list(argv) + ["--json"]))


def _cp(cp, comm_type="p2p"):
    return ["--context-parallel-size", str(cp), "--cp-comm-type", comm_type]


def _bench():
    sys.path.insert(0, BENCH_DIR)
    try:
        import bench_context_parallel as bench
    finally:
        sys.path.remove(BENCH_DIR)
    return bench


def _hierarchical(a2a, ring):
    return ["--hierarchical-context-parallel-sizes", str(a2a), str(ring)]


@pytest.mark.parametrize("comm_type,fwd,bwd", [("p2p", 3 * 2, 3 * 2 + 4 * 2),
                                               ("all_gather", 3 * 2, 2 * 3 * 2),
                                               ("a2a", 3, 3)])
def test_cp_bytes_per_step_equal_the_formula_on_the_link_the_cp_group_spans(comm_type, fwd,
                                                                           bwd):
    """cp 4, 4 layers, 16 micro-batches, bf16: X = 512/4 tokens x 8 heads x 32 x 2 B per
    layer; a2a moves 4X x (cp-1)/cp = 3X each way."""
    doc = _plan(["--gpu", "h100-sxm", "--num-gpus", "4"] + _cp(4, comm_type) + CP_SMALL)
    x = 512 // 4 * 8 * 32 * 2
    assert doc["layout"]["cp"] == 4 and doc["layout"]["cp_comm_type"] == comm_type
    step = doc["step"]
    assert step["cp_bytes"] == 16 * 4 * (fwd + bwd) * x
    intra = doc["gpu"]["intra_node_gbps"] * 1e9 * NETWORK_EFFICIENCY
    assert step["cp_communication_s"] == pytest.approx(step["cp_bytes"] / intra)
    if comm_type == "p2p":  # the hops are smaller than the blocks' compute here
        assert step["cp_exposed_s"] < step["cp_communication_s"]
    else:
        assert step["cp_exposed_s"] == pytest.approx(step["cp_communication_s"])
    # 2 GPUs per node: the cp group of 4 spans nodes and its traffic takes the NIC
    slow = _plan(["--gpu", "h100-sxm", "--num-gpus", "4", "--gpus-per-node", "2"] +
                 _cp(4, comm_type) + CP_SMALL)["step"]
    inter = doc["gpu"]["inter_node_gbps"] * 1e9 * NETWORK_EFFICIENCY
    assert slow["cp_communication_s"] == pytest.approx(step["cp_bytes"] / inter)


def test_a2a_p2p_activations_and_bytes_equal_the_bench_not_a2a_over_the_whole_group():
    """cp 4 as 2 x 2 on the bench's model: the orders index 2 x 128 tokens, not a2a's 512
    (4 KiB less), and the bytes are a2a's over 2 ranks plus the ring's over 2."""
    bench = _bench()
    row = bench.measure(4, bench.tiny_config(512, 1), "a2a+p2p")
    assert row["measured_bytes"] == row["formula_bytes"]
    argv = ["--gpu", "cpu", "--num-gpus", "4"] + _cp(4, "a2a+p2p") + _hierarchical(2, 2)
    doc = _plan(argv + BENCH)
    assert doc["stages"][0]["bytes"]["activations"] == row["activation_bytes"]
    assert doc["step"]["cp_bytes"] == sum(row["formula_bytes"].values())
    assert doc["layout"]["hierarchical_context_parallel_sizes"] == [2, 2]
    whole = _plan(["--gpu", "cpu", "--num-gpus", "4"] + _cp(4, "a2a") + BENCH)
    assert whole["stages"][0]["bytes"]["activations"] != row["activation_bytes"]
    assert whole["step"]["cp_bytes"] != doc["step"]["cp_bytes"]


def test_a2a_p2p_all_to_all_on_the_inner_link_and_the_ring_across_nodes():
    """cp 4 as 2 x 2, 2 GPUs per node: the all-to-all stays in the node, the ring crosses."""
    bench = _bench()
    argv = ["--gpu", "h100-sxm", "--num-gpus", "4"] + _cp(4, "a2a+p2p") + _hierarchical(2, 2)
    doc = _plan(argv + ["--gpus-per-node", "2"] + CP_SMALL)
    formula = bench.comm_bytes_formula("a2a+p2p", 4, 1, 512, 8, 32, 4, width=2)
    step, m = doc["step"], 16  # micro-batches per step
    assert step["cp_bytes"] == m * (formula["all_to_all"] + formula["send"])
    intra, inter = (doc["gpu"][k] * 1e9 * NETWORK_EFFICIENCY
                    for k in ("intra_node_gbps", "inter_node_gbps"))
    a2a_s = m * formula["all_to_all"] / intra
    assert step["cp_communication_s"] == pytest.approx(a2a_s + m * formula["send"] / inter)
    assert a2a_s <= step["cp_exposed_s"] < step["cp_communication_s"]


def test_parameters_unchanged_and_zero_shards_over_dp_times_cp():
    def stage(num_gpus, cp):
        argv = ["--gpu", "h100-sxm", "--num-gpus", str(num_gpus), "--zero-stage", "2"]
        return _plan(argv + _cp(cp) + CP_SMALL)["stages"][0]

    alone, cp2, dp2 = stage(1, 1), stage(2, 2), stage(2, 1)
    assert cp2["parameters"] == alone["parameters"]
    assert cp2["bytes"]["params"] == alone["bytes"]["params"]
    for kind in ("grads", "master_params", "optimizer_state"):
        assert cp2["bytes"][kind] == dp2["bytes"][kind] < alone["bytes"][kind], kind
    assert cp2["bytes"]["activations"] < 0.6 * dp2["bytes"]["activations"]


def test_moe_expert_state_shards_over_tp_cp_dp_over_etp_ep():
    """edp = tp x cp x dp / (etp x ep): cp2 x dp4 x ep2 holds the expert state of edp 4."""
    moe = CASES["moe"][4:] + ["--attention-dropout", "0"]
    doc = _plan(["--gpu", "h100-sxm", "--num-gpus", "8"] + _cp(2) + moe)
    dp8 = _plan(["--gpu", "h100-sxm", "--num-gpus", "8", "--zero-stage", "1"] + moe)
    cp2 = _plan(["--gpu", "h100-sxm", "--num-gpus", "8", "--zero-stage", "1"] + _cp(2) + moe)
    assert doc["layout"]["edp"] == 4 and doc["layout"]["dp"] == 4
    assert cp2["stages"][0]["expert_bytes"] == dp8["stages"][0]["expert_bytes"]


def test_search_includes_cp_where_the_sequence_splits_in_2cp_chunks():
    assert context_sizes(8, 512) == [1, 2, 4, 8]
    assert context_sizes(8, 12) == [1, 2]
    doc = _plan(["--search", "--gpu", "h100-sxm", "--num-gpus", "4"] + CP_SMALL)
    cps = {p["layout"].get("cp", 1) for p in doc["ranked"]}
    assert cps == {1, 2, 4}
    text = _plan_output(["--search", "--top", "500", "--gpu", "h100-sxm", "--num-gpus", "4"]
                        + CP_SMALL)
    assert " cp=2 " in text and " cp=4 " in text
    assert all(p["layout"].get("cp_comm_type", "p2p") == "p2p" for p in doc["ranked"])
    asked = _plan(["--search", "--gpu", "h100-sxm", "--num-gpus", "4"] + _cp(4, "a2a+p2p") +
                  _hierarchical(2, 2) + CP_SMALL)["ranked"]
    sizes = {(p["layout"].get("cp", 1), p["layout"].get("cp_comm_type"),
              tuple(p["layout"].get("hierarchical_context_parallel_sizes", ()))) for p in asked}
    assert sizes == {(1, None, ()), (2, "a2a+p2p", (2, 1)), (4, "a2a+p2p", (2, 2))}
    # with attention dropout (the default 0.1) the run's validation refuses every cp layout
    refused = _plan(["--search", "--gpu", "h100-sxm", "--num-gpus", "4"] + SMALL)["refused"]
    with_cp = [r for r in refused if r["layout"].get("cp", 1) > 1]
    assert with_cp and all("attention dropout under context parallelism" in r["reason"]
                           for r in with_cp)


GOLDEN = {  # sha256 of `gigatron plan` output of plans without cp (issue 32: GEMM waves,
    # attention dropout's price; issue 42: ZeRO-3's first gather unit per pass exposed)
    "tp2_pp2_dp2": "8d74708d8761a3141f0ecd4626b4a0a0c366c66cc2e749127129b5a2fff5341e",
    "tp2_pp2_dp2_json": "8fcb3b4cc31871e8bd9decee67a34ae2524ef96538b13116762a84000e07197b",
    "zero3_full_recompute": "4e6697dd5392774c39dd0ce8b7a6aba015059461ac5663031f548dfa8f3b59b8",
    "zero3_full_recompute_json":
        "312734e0d9b222e61edff57908f606d8bab7feee83f1f08be608eac59636a780",
    "gpt3_175b": "77f3cf5944b2de60fe5b68a64055837753e028736faff928451474f640895638",
    "gpt3_175b_json": "98322c4ce7485e0fa4e7e749090a9a7d506b04e9e25352481a6a62177b083122",
    "moe": "ea1745fd4d8b28fc1e457e67b8a95112d1b92e03c35eeed114fae8356952a2e5",
    "moe_json": "3727daa39f525e45a0bbb757b76f68ad0e1979019941b69c661cc34477f9f217",
}
CASES = {
    "tp2_pp2_dp2": ["--gpu", "a100-80gb", "--num-gpus", "8", "--tensor-model-parallel-size",
                    "2", "--pipeline-model-parallel-size", "2"] + SMALL,
    "zero3_full_recompute": ["--gpu", "h100-sxm", "--num-gpus", "4", "--zero-stage", "3",
                             "--recompute-granularity", "full", "--recompute-method",
                             "uniform", "--recompute-num-layers", "1"] + SMALL,
    "gpt3_175b": ("--gpu h100-sxm --num-gpus 512 --model gpt3-175b "
                  "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                  "--micro-batch-size 1 --global-batch-size 1536 --bf16 --lr 1e-4 "
                  "--train-iters 1 --mock-data").split(),
    "moe": ["--gpu", "h100-sxm", "--num-gpus", "4", "--num-experts", "4", "--moe-router-topk",
            "2", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "256",
            "--disable-bias-linear"] + SMALL,
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_plans_without_cp_are_byte_identical_to_before_cp(name):
    json_form = name.endswith("_json")
    argv = CASES[name[:-5] if json_form else name] + (["--json"] if json_form else [])
    digest = hashlib.sha256(_plan_output(argv).encode()).hexdigest()
    assert digest == GOLDEN[name]
