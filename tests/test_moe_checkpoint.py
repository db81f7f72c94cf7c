"""MoE checkpoints are layout-free across expert-parallel sizes: each rank saves its box of the
stacked experts (experts over ep, each expert's ffn over etp, SwiGLU's halves each sliced)
and its ZeRO shards of their optimizer state under the global tensors' boxes, and any layout
reads back exactly the boxes it holds.

Pure: every (ep, etp) rank's box of weight1/weight2, and any ZeRO range of it, lands on its
own elements of the global tensor, which the ranks cover once.

Real runs (pretrain.main on forked gloo ranks, --mock-data, fp32, dropless): a tiny
Mixtral-shaped MoE GPT (SwiGLU experts, top-2 of 4 softmax after top-k, aux and z losses,
RoPE, RMSNorm) trains 2 iterations at ep2 x edp2 (dp 4, ZeRO-1: expert moments sharded over
edp, dense ones over dp) and saves; the run resumed at ep4 (ZeRO-1), tp2 x ep2 with sequence
parallelism at etp 1 (ZeRO-1) and etp 2, and at one rank logs the uninterrupted one-rank
run's loss at iteration 3 (the loaded weights') and ends with its parameters after that step
(the loaded Adam moments' and step count's update) within 1e-6 (relative L2 of each full
parameter). A resume that lost the Adam moments, or read an expert box into another rank's
experts, misses by orders of magnitude. `gigatron convert gigatron-to-hf` of the ep2
checkpoint writes the same Mixtral tensors as the one-rank run's checkpoint of the same
iteration (1e-6), and `hf-to-gigatron` of that folder gives back the ep2 run's parameters
bit for bit. The aux-loss-free expert bias (a replicated buffer) is saved once and restored.
"""
from __future__ import annotations

import os

import pytest
import torch

from multirank import run_on_ranks

TOL = 1e-6
SAVED_AT, ITERS = 2, 4  # MIXTRAL's: other files import it
MIXTRAL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
           "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 8 "
           "--lr 3e-3 --mock-data --vocab-size 128 --eval-iters 0 --no-progress "
           "--make-vocab-size-divisible-by 8 --init-method-std 0.1 --disable-bias-linear "
           "--swiglu --normalization RMSNorm --position-embedding-type rope "
           "--untie-embeddings-and-output-weights --num-experts 4 --moe-ffn-hidden-size 16 "
           "--moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 --hidden-dropout 0 "
           "--attention-dropout 0 --log-interval 1 --lr-warmup-iters 0 "
           f"--train-iters {ITERS} --save-interval {SAVED_AT}").split()
# this file's runs (but the expert bias test's) stop one step after the save: a 4th step cost
# each resumed 4-rank run ~1/4 of its CPU
RUN_ITERS = SAVED_AT + 1
RUN = MIXTRAL + ["--train-iters", str(RUN_ITERS)]
SAVE_LAYOUT = "--expert-model-parallel-size 2 --zero-stage 1 " \
              "--moe-token-dispatcher-type alltoall".split()
SP = "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 2".split()
RESUMES = {
    "ep4_zero1": (4, "--expert-model-parallel-size 4 --zero-stage 1 "
                     "--moe-token-dispatcher-type allgather".split()),
    "tp2_ep2_etp1_sp_zero1": (4, SP + "--expert-tensor-parallel-size 1 --zero-stage 1 "
                                      "--moe-token-dispatcher-type alltoall".split()),
    "tp2_ep2_etp2_sp": (4, SP + ["--moe-token-dispatcher-type", "allgather"]),
    "one_rank": (1, []),
}


# ---- pure: the expert boxes ----------------------------------------------------------------
@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("which", ["weight1", "weight2"])
def test_expert_boxes_cover_the_global_tensor_once_with_their_values(ep, etp, which):
    from gigatron.parallel.expert.init import expert_box, mark_expert_parallel
    from gigatron.parallel.tensor.init import InitSpec
    from gigatron.training.checkpoint.torch_dist.planner import ShardedValue
    from gigatron.training.checkpoint.torch_dist.state import add_flat, placement_of

    experts, h, f = 4, 3, 8
    shape, dim, stride = ((experts, h, 2 * f), 2, 2) if which == "weight1" else \
        ((experts, f, h), 1, 1)
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    hits, out = torch.zeros(shape), torch.full(shape, float("nan"))
    for ep_rank in range(ep):
        for etp_rank in range(etp):
            splits = ((0, ep_rank, ep, 1), (dim, etp_rank, etp, stride))
            local = torch.nn.Parameter(expert_box(full, splits).clone())
            local.init_spec = InitSpec("normal", shape, 0.1)
            mark_expert_parallel(local, splits)
            placement = placement_of(local, tp_rank=1, tp_size=2)  # tp plays no part
            flat, n = local.detach().reshape(-1), local.numel()
            for start in range(0, n, 7):  # ZeRO ranges of the box, cut anywhere
                value = ShardedValue(shape)
                add_flat(value, flat[start:start + 7], start, placement)
                for offsets, t in value.pieces:
                    region = tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))
                    out[region] = t
                    hits[region] += 1
                assert sum(t.numel() for _, t in value.pieces) == min(7, n - start)
    assert torch.equal(hits, torch.ones(shape)) and torch.equal(out, full)


# ---- real runs -----------------------------------------------------------------------------
def _train(rank, world, argv, metrics):
    """pretrain.main(argv); this rank's parameters and persistent buffers at the loop's end
    (name -> (tensor with tp slices gathered, expert splits or None))."""
    from gigatron.training.run import loop, pretrain
    from test_moe_parallel import _local_parameters

    real_train, captured = loop.train, {}

    def train(session, progress):
        result = real_train(session, progress)
        params = _local_parameters(session.chunks, session.groups)
        for chunk in session.chunks:
            for name, buffer in chunk.state_dict(keep_vars=True).items():
                if not isinstance(buffer, torch.nn.Parameter):
                    params[name] = (buffer.detach().clone(), None)
        captured["params"] = params
        return result

    loop.train = train
    assert pretrain.main(argv + ["--metrics-file", metrics]) == 0
    return captured["params"]


def _launch(world, argv, folder):
    """(losses per iteration, full parameters) of one run."""
    from test_moe_parallel import _full_parameters, _losses

    metrics = os.path.join(folder, "metrics.jsonl")
    per_rank = run_on_ranks(_train, world, argv, metrics, timeout=300)
    return _losses(metrics), _full_parameters(per_rank)


def _relative(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _worst(got, want):
    assert set(got) == set(want)
    return max(_relative(got[n], want[n]) for n in want)


def _loss_error(got, want):
    assert len(got) == len(want)
    return max(abs(g[k] - w[k]) / abs(w[k]) for g, w in zip(got, want) for k in w)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted one-rank run (saving at 2 and 4) and the ep2 run that saves at 2."""
    one = str(tmp_path_factory.mktemp("one_rank"))
    ep2 = str(tmp_path_factory.mktemp("ep2"))
    one_losses, one_params = _launch(1, RUN + ["--save", one], one)
    ep2_losses, ep2_params = _launch(4, RUN + SAVE_LAYOUT + [
        "--save", ep2, "--exit-interval", str(SAVED_AT)], ep2)
    assert len(one_losses) == RUN_ITERS and len(ep2_losses) == SAVED_AT
    assert _loss_error(ep2_losses, one_losses[:SAVED_AT]) <= TOL
    return {"one": (one, one_losses, one_params), "ep2": (ep2, ep2_params)}


@pytest.mark.parametrize("layout", list(RESUMES))
def test_an_ep2_checkpoint_resumes_in_any_layout_as_the_uninterrupted_run(runs, tmp_path,
                                                                          layout):
    _, one_losses, one_params = runs["one"]
    ep2, _ = runs["ep2"]
    world, argv = RESUMES[layout]
    losses, params = _launch(world, RUN + argv + ["--load", ep2], str(tmp_path))
    assert len(losses) == RUN_ITERS - SAVED_AT  # it resumed at the saved iteration
    loss_error = _loss_error(losses, one_losses[SAVED_AT:])
    param_error = _worst(params, one_params)
    assert loss_error <= TOL and param_error <= TOL, (loss_error, param_error)


def test_hf_export_of_an_ep2_checkpoint_equals_the_one_rank_export(runs, tmp_path):
    from gigatron.cli import convert as convert_cli
    from gigatron.training.checkpoint.convert import load_model
    from gigatron.training.checkpoint.folders import iteration_dir
    from safetensors.torch import load_file

    one, _, _ = runs["one"]
    ep2, ep2_params = runs["ep2"]
    exported = {}
    for name, load in (("one", iteration_dir(one, SAVED_AT)), ("ep2", ep2)):
        out = str(tmp_path / name)
        assert convert_cli.main(["gigatron-to-hf", "--load", load, "--save", out,
                                 "--family", "mixtral"]) == 0
        exported[name] = {k: v for f in sorted(os.listdir(out)) if f.endswith(".safetensors")
                          for k, v in load_file(os.path.join(out, f)).items()}
    assert any(".block_sparse_moe.experts.3." in k for k in exported["ep2"])
    assert _worst(exported["ep2"], exported["one"]) <= TOL
    back = str(tmp_path / "back")
    assert convert_cli.main(["hf-to-gigatron", "--load", str(tmp_path / "ep2"),
                             "--save", back]) == 0
    _, state = load_model(back)
    assert set(state) == set(ep2_params)
    for name, tensor in ep2_params.items():
        assert torch.equal(state[name], tensor), name


def test_the_expert_bias_is_saved_once_and_loads_back_exactly(tmp_path):
    """A DeepSeek-style block (sigmoid scores, expert bias, a shared expert) saved at
    tp2 x ep2 (etp 1) loads at one rank into exactly the saved parameters and bias."""
    from gigatron.training.checkpoint.folders import iteration_dir
    from gigatron.training.checkpoint.torch_dist.save_load import entries

    argv = MIXTRAL + ["--moe-router-score-function", "sigmoid",
                      "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
                      "0.01", "--moe-shared-expert-intermediate-size", "16",
                      "--train-iters", str(SAVED_AT)]
    saved = str(tmp_path / "saved")
    _, at_save = _launch(4, argv + SP + ["--expert-tensor-parallel-size", "1",
                                         "--save", saved], saved)
    bias = "decoder.layers.1.mlp.router.expert_bias"
    assert at_save[bias].abs().max() > 0  # the steps moved it
    stored = entries(iteration_dir(saved, SAVED_AT))["model." + bias]
    assert len(stored.chunks) == 1 and tuple(stored.chunks[0].sizes) == (4,)
    loaded_dir = str(tmp_path / "loaded")
    os.makedirs(loaded_dir)
    losses, loaded = _launch(1, argv + ["--load", saved], loaded_dir)
    assert losses == []  # nothing left to train: what the load put in the model
    assert set(loaded) == set(at_save)
    for name, tensor in at_save.items():
        assert torch.equal(loaded[name], tensor), name
