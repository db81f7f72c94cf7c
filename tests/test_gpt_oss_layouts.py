"""A gpt-oss-style model (sliding windows 3,0 on every other layer, learned sinks, biases on
q/k/v/o, quick GeGLU with offset 1 and clamp 7, RMSNorm, RoPE, GQA) trains the same under
tp2 (sinks split with the heads), cp2 with each --cp-comm-type (windows skip whole key
chunks: the 16 tokens split in 4 chunks of 4), cp4 as a2a+p2p 2 x 2 and pp2 as on one rank: the real program
(pretrain.main, forked gloo ranks, --mock-data, fp32) logs the one-rank losses at both
iterations and ends with the one-rank parameters, sinks included (relative 1e-4). Two
iterations, as tests/test_moe_parallel.py's layouts: Adam's second update weighs the two
steps' gradients against each other (a third cost ~1/4 of each run's CPU). Its MoE
form (4 quick-GeGLU experts with biases, a router with a bias, top-2) trains the same at ep2
(alltoall) and tp2 x ep2 with sequence parallelism."""
import pytest

from test_context_parallel import GPT, RTOL, ROPE, _losses, _relative
from multirank import run_on_ranks
from test_moe_parallel import train_and_gather

GPT_OSS = ("--window-size 3,0 --window-attn-skip-freq 2 --softmax-type learnable --quick-geglu "
           "--glu-linear-offset 1 --activation-func-clamp-value 7 --normalization RMSNorm "
           "--group-query-attention --num-query-groups 2 --ffn-hidden-size 48").split()
ITERS = 2
BASE = [f for f in GPT if f != "--disable-bias-linear"] + ROPE + GPT_OSS
BASE[BASE.index("--train-iters") + 1] = str(ITERS)
LAYOUTS = {
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "cp2_p2p": (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    "cp2_all_gather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather"]),
    "cp2_a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "cp4_a2a_p2p_2x2": (4, "--context-parallel-size 4 --cp-comm-type a2a+p2p "
                           "--hierarchical-context-parallel-sizes 2 2".split()),
}
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 48 "
       "--moe-token-dispatcher-type alltoall").split()
MOE_LAYOUTS = {
    "moe_ep2": (2, ["--expert-model-parallel-size", "2"]),
    "moe_tp2_ep2_sp": (4, "--tensor-model-parallel-size 2 --sequence-parallel "
                          "--expert-model-parallel-size 2".split()),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """dense or MoE -> (one rank's full parameters, its losses), built on first use."""
    cache = {}

    def get(moe):
        if moe not in cache:
            metrics = str(tmp_path_factory.mktemp("one") / "one.jsonl")
            argv = BASE + (MOE if moe else [])
            params = train_and_gather(1, argv, metrics)
            assert any(n.endswith("softmax_offset") for n in params)
            assert not moe or any(n.endswith("experts.bias1") for n in params)
            cache[moe] = params, _losses(metrics)
        return cache[moe]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS) + list(MOE_LAYOUTS))
def test_gpt_oss_layout_trains_the_one_rank_model(references, tmp_path, layout):
    moe = layout in MOE_LAYOUTS
    ref_params, ref_losses = references(moe)
    ranks, flags = (MOE_LAYOUTS if moe else LAYOUTS)[layout]
    metrics = str(tmp_path / "metrics.jsonl")
    argv = BASE + (MOE if moe else []) + flags
    params = train_and_gather(ranks, argv, metrics)
    losses = _losses(metrics)
    assert len(losses) == ITERS == len(ref_losses)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert set(ref_params) <= set(params)
    param_error = max(_relative(params[n], ref_params[n]) for n in ref_params)
    print(f"{layout}: loss error {loss_error:.2e}, param error {param_error:.2e}")
    assert loss_error <= RTOL and param_error <= RTOL, (loss_error, param_error)


def _pretrain(rank, world, argv):
    from gigatron.training.run import pretrain

    return pretrain.main(argv)


def _without(argv, flag):
    """`argv` without `flag` and its value."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]


def test_use_checkpoint_args_takes_the_gpt_oss_flags(tmp_path):
    """--use-checkpoint-args takes the window, sink and gated-MLP flags (and --add-qkv-bias,
    which Megatron takes) from the checkpoint, as every other shape flag: a run given none
    of them loads a gpt-oss-style checkpoint strictly and fine-tunes it."""
    ckpt = str(tmp_path / "ckpt")
    base = _without(BASE, "--train-iters") + ["--train-iters", "1"]
    first = base + ["--save", ckpt, "--save-interval", "1"]
    assert run_on_ranks(_pretrain, 1, first, timeout=300) == [0]
    plain = [f for f in base if f != "--quick-geglu"]
    for flag in ("--window-size", "--window-attn-skip-freq", "--softmax-type",
                 "--glu-linear-offset", "--activation-func-clamp-value"):
        plain = _without(plain, flag)
    resumed = plain + ["--load", ckpt, "--finetune", "--use-checkpoint-args"]
    assert run_on_ranks(_pretrain, 1, resumed, timeout=300) == [0]
