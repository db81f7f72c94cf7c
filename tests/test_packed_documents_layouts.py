"""--reset-attention-mask --reset-position-ids --eod-mask-loss train the same model in every
layout: the real program (pretrain.main on forked gloo ranks, fp32) over a tiny Megatron
dataset of short documents (3 to 12 tokens, each ending in eod, so a 16-token sample packs
2 to 5 of them) logs the one-rank losses at both iterations and ends with the one-rank
parameters (relative 1e-4; with ep2, those outside the experts, which each rank holds
half of) under cp2 (p2p; the other comm types: test_packed_documents.py), tp2 (sequence
parallel) x pp2, pp2 interleaved and MoE with ep2; --reset-position-ids alone (RoPE across documents, positions
restarting) under pp2, where the last stage must take the data's positions. The newer
attention kinds: gpt-oss's sliding window with sinks and MoE under pp2 interleaved with full
recomputation, multi-latent attention under cp2 with selective recomputation. Two
iterations (16 samples of 16 tokens, ~35 documents), as tests/test_moe_parallel.py's
layouts: Adam's second update weighs the two steps' gradients against each other (a third
cost ~1/4 of each run's CPU).
"""
import numpy as np
import pytest

from gigatron.data.indexed_dataset import IndexedDatasetBuilder
from multirank import run_on_ranks
from test_context_parallel import RTOL, _losses, _relative, _train_layout

VOCAB = 128  # NullTokenizer: eod is its last id
ITERS = 2
RESETS = ["--reset-attention-mask", "--reset-position-ids"]
LAYOUTS = {
    "cp2_p2p": (2, "--context-parallel-size 2 --cp-comm-type p2p"),
    "tp2_pp2_sp": (4, "--tensor-model-parallel-size 2 --sequence-parallel "
                      "--pipeline-model-parallel-size 2"),
    "pp2_interleaved": (2, "--pipeline-model-parallel-size 2 "
                           "--num-layers-per-virtual-pipeline-stage 1"),
    "ep2_moe": (2, "--expert-model-parallel-size 2"),
}
MOE = "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01".split()
# the newer attention kinds in the layouts they meet: gpt-oss's sliding window (every other
# layer) with sinks, MoE over ep2, interleaved pp2 and full recomputation; multi-latent
# attention under cp2 and interleaved pp2 with selective recomputation
GPT_OSS = ("--window-size 3,0 --window-attn-skip-freq 2 --softmax-type learnable "
           "--normalization RMSNorm --group-query-attention --num-query-groups 2").split() + MOE
MLA = ("--multi-latent-attention --q-lora-rank 16 --kv-lora-rank 12 --qk-head-dim 8 "
       "--qk-pos-emb-head-dim 4 --v-head-dim 6 --qk-layernorm --normalization RMSNorm").split()
KINDS = {
    "gptoss_pp2_interleaved_recompute": (
        2, GPT_OSS, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 "
                    "--recompute-granularity full --recompute-method uniform "
                    "--recompute-num-layers 1"),
    "mla_cp2_recompute": (2, MLA, "--context-parallel-size 2 --recompute-granularity selective"),
}


@pytest.fixture(scope="module")
def data_flags(tmp_path_factory):
    prefix = str(tmp_path_factory.mktemp("docs") / "docs")
    rng = np.random.default_rng(0)
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for n in rng.integers(3, 13, 400):
        builder.add_item(np.append(rng.integers(0, VOCAB - 1, n - 1), VOCAB - 1))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
            "--lr 3e-3 --tokenizer-type NullTokenizer --vocab-size 128 --split 100,0,0 "
            "--eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 "
            "--init-method-std 0.1 --hidden-dropout 0 --attention-dropout 0 "
            "--disable-bias-linear --eod-mask-loss --position-embedding-type rope "
            f"--log-interval 1 --train-iters {ITERS} --lr-warmup-iters 0").split() + [
        "--data-path", prefix]


def _run(ranks, flags, tmp_path, name):
    metrics = str(tmp_path / f"{name}.jsonl")
    per_rank = run_on_ranks(_train_layout, ranks, flags, metrics, timeout=300)
    params = {}
    for rank_params in per_rank:
        params.update(rank_params)
    return params, _losses(metrics)


def _assert_same(got, want, what):
    (params, losses), (ref_params, ref_losses) = got, want
    assert len(losses) == ITERS == len(ref_losses)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param_error = max(_relative(params[n], ref_params[n]) for n in ref_params
                      if "ep2" not in what or ".experts." not in n)
    print(f"{what}: loss error {loss_error:.2e}, param error {param_error:.2e}")
    assert loss_error <= RTOL and param_error <= RTOL, (what, loss_error, param_error)


@pytest.fixture(scope="module")
def references(data_flags, tmp_path_factory):
    path = tmp_path_factory.mktemp("one")
    refs = {name: _run(1, data_flags + extra, path, name) for name, extra in (
        ("dense", RESETS), ("moe", RESETS + MOE), ("positions", RESETS[1:]))}
    for kind, (_, flags, _) in KINDS.items():
        refs[kind] = _run(1, data_flags + RESETS + flags, path, kind)
    return refs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_documents_train_the_one_rank_model(references, data_flags, tmp_path, layout):
    ranks, flags = LAYOUTS[layout]
    moe = layout.endswith("moe")
    got = _run(ranks, data_flags + RESETS + (MOE if moe else []) + flags.split(), tmp_path,
               layout)
    _assert_same(got, references["moe" if moe else "dense"], layout)


def test_reset_position_ids_alone_reach_the_last_pipeline_stage(references, data_flags,
                                                                tmp_path):
    got = _run(2, data_flags + RESETS[1:] + ["--pipeline-model-parallel-size", "2"], tmp_path,
               "positions_pp2")
    _assert_same(got, references["positions"], "positions pp2")



@pytest.mark.parametrize("kind", list(KINDS))
def test_packed_documents_with_the_new_attention_kinds_train_the_one_rank_model(
        references, data_flags, tmp_path, kind):
    ranks, flags, layout = KINDS[kind]
    got = _run(ranks, data_flags + RESETS + flags + layout.split(), tmp_path, kind)
    _assert_same(got, references[kind], kind)
