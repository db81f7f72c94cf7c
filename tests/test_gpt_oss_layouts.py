"""A gpt-oss-style model (sliding windows 3,0 on every other layer, learned sinks, biases on
q/k/v/o, quick GeGLU with offset 1 and clamp 7, RMSNorm, RoPE, GQA) trains the same under
tp2 (sinks split with the heads), cp2 with each --cp-comm-type (windows skip whole key
chunks: the 16 tokens split in 4 chunks of 4) and pp2 as on one rank: the real program
(pretrain.main, forked gloo ranks, --mock-data, fp32) logs the one-rank losses at every
iteration and ends with the one-rank parameters, sinks included (relative 1e-4)."""
import pytest

from multirank import run_on_ranks
from test_context_parallel import GPT, ITERS, RTOL, ROPE, _losses, _relative, _train_layout

GPT_OSS = ("--window-size 3,0 --window-attn-skip-freq 2 --softmax-type learnable --quick-geglu "
           "--glu-linear-offset 1 --activation-func-clamp-value 7 --normalization RMSNorm "
           "--group-query-attention --num-query-groups 2 --ffn-hidden-size 48").split()
BASE = [f for f in GPT if f != "--disable-bias-linear"] + ROPE + GPT_OSS
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "cp2_p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "cp2_all_gather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    "cp2_a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    metrics = str(tmp_path_factory.mktemp("one") / "one.jsonl")
    params = run_on_ranks(_train_layout, 1, BASE, metrics, timeout=300)[0]
    assert any(n.endswith("softmax_offset") for n in params)
    return params, _losses(metrics)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt_oss_layout_trains_the_one_rank_model(reference, tmp_path, layout):
    ref_params, ref_losses = reference
    ranks, flags = LAYOUTS[layout]
    metrics = str(tmp_path / "metrics.jsonl")
    per_rank = run_on_ranks(_train_layout, ranks, BASE + flags, metrics, timeout=300)
    losses = _losses(metrics)
    assert len(losses) == ITERS == len(ref_losses)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    params = {}
    for rank_params in per_rank:
        params.update(rank_params)
    assert set(ref_params) <= set(params)
    param_error = max(_relative(params[n], ref_params[n]) for n in ref_params)
    print(f"{layout}: loss error {loss_error:.2e}, param error {param_error:.2e}")
    assert loss_error <= RTOL and param_error <= RTOL, (loss_error, param_error)
