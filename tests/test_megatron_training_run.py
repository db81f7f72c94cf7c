"""The whole program with Megatron's samples-based flags on forked CPU ranks: a batch ramp-up
grows the micro-batches per step exactly as Megatron's calculator does, every step consumes
its batch, the lr follows Megatron's schedule at the consumed samples, a checkpoint is saved
when the micro-batch count changes; --exit-duration-in-mins saves and stops; the banner says
what accepted flags map to."""
import json
import os
import sys

from multirank import run_on_ranks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_megatron_samples import megatron_batch, megatron_lr, megatron_train_iters  # noqa

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --min-lr 1e-3 --mock-data "
         "--vocab-size 128 --hidden-dropout 0 --attention-dropout 0 --log-interval 1 "
         "--eval-iters 0 --no-progress --make-vocab-size-divisible-by 8").split()


def _main(rank, world, argv):
    import contextlib
    import io

    from gigatron.training.run import pretrain

    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = pretrain.main(argv)
    return code, err.getvalue(), out.getvalue()


def _program_on(world, argv):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return run_on_ranks(_main, world, argv)


def _records(path, kind="train"):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r.get("type") == kind]


def test_rampup_grows_the_batch_as_megatron_and_the_lr_follows_the_samples(tmp_path):
    ckpt, metrics = str(tmp_path / "ckpt"), str(tmp_path / "m.jsonl")
    argv = FLAGS + ["--train-samples", "40", "--rampup-batch-size", "4", "4", "16",
                    "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.15",
                    "--save", ckpt, "--metrics-file", metrics, "--ckpt-format", "torch_dist",
                    "--transformer-impl", "transformer_engine", "--distributed-backend",
                    "nccl", "--use-flash-attn"]
    results = _program_on(2, argv)
    assert [r[0] for r in results] == [0, 0], results[0][1]
    records = _records(metrics)
    iterations = megatron_train_iters(40, 8, (4, 4, 16))
    assert [r["iteration"] for r in records] == list(range(1, iterations + 1)) and \
        iterations == 7
    consumed = 0
    for r in records:
        batch = megatron_batch(consumed, 4, 4, 16, 8)
        lr = megatron_lr(consumed, 0.15 * 40, 40, 1e-2, 1e-3, 0.0, "cosine")
        consumed += batch
        assert (r["global_batch_size"], r["consumed_samples"]) == (batch, consumed), r
        assert abs(r["lr"] - lr) <= 1e-12, (r["iteration"], r["lr"], lr)
    assert [r["global_batch_size"] for r in records] == [4, 4, 4, 4, 8, 8, 8]
    saved = [r["iteration"] for r in _records(metrics, "checkpoint")]
    assert saved == [4, 7]  # the ramp changed the micro-batches per step after iteration 4
    out = results[0][2]
    for note in ("--transformer-impl transformer_engine: Transformer Engine is",
                 "--distributed-backend nccl: no GPU here, gloo is used",
                 "--use-flash-attn: core attention is torch scaled_dot_product_attention",
                 "batch ramp-up 4 -> 8 by 4 over 16 samples, 7 iterations",
                 "mlp gelu_tanh, positions learned_absolute"):
        assert note in out, out


def test_exit_duration_saves_and_stops(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--train-iters", "5", "--exit-duration-in-mins", "1e-9", "--save", ckpt]
    results = _program_on(1, argv)
    code, err, out = results[0]
    assert code == 0, err
    assert "exiting after" in out and "at iteration 1 (--exit-duration-in-mins 1e-09)" in out
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"


# Megatron-LM examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.14.0): every flag as
# written except the sizes (shrunk to a CPU), the data files (mock data) and the paths
GPT3_175B = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
             "--max-position-embeddings 16 --attention-backend auto --micro-batch-size 1 "
             "--global-batch-size 8 --rampup-batch-size 2 2 8 --train-iters 4 "
             "--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 "
             "--clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 "
             "--lr-warmup-fraction .001 --lr-decay-iters 3 --tensor-model-parallel-size 1 "
             "--pipeline-model-parallel-size 2 --split 949,50,1 --log-interval 1 "
             "--save-interval 10000 --eval-interval 1000 --eval-iters 1 "
             "--mock-data --vocab-size 128 --no-progress").split()


def test_megatron_gpt3_175b_example_flags_train_two_ranks(tmp_path):
    ckpt, tb, metrics = (str(tmp_path / n) for n in ("ckpt", "tb", "m.jsonl"))
    argv = GPT3_175B + ["--save", ckpt, "--load", ckpt, "--tensorboard-dir", tb,
                        "--metrics-file", metrics]
    results = _program_on(2, argv)
    assert [r[0] for r in results] == [0, 0], results[0][1] + results[1][1]
    records = _records(metrics)
    consumed, batches = 0, []
    for _ in range(4):
        batches.append(megatron_batch(consumed, 2, 2, 8, 8))
        consumed += batches[-1]
    assert [r["global_batch_size"] for r in records] == batches == [2, 2, 4, 8]
    assert all(r["lm loss"] == r["lm loss"] for r in records)  # finite (fp16 on CPU)
    assert "--rampup-batch-size with --train-iters" in results[0][2]


def test_resume_in_the_middle_of_a_ramp_continues_exactly(tmp_path):
    base = FLAGS + ["--train-samples", "40", "--rampup-batch-size", "4", "4", "16"]
    whole, resumed = str(tmp_path / "whole.jsonl"), str(tmp_path / "resumed.jsonl")
    ckpt = str(tmp_path / "ckpt")
    assert [r[0] for r in _program_on(2, base + ["--metrics-file", whole])] == [0, 0]
    first = _program_on(2, base + ["--metrics-file", resumed, "--save", ckpt,
                                   "--exit-interval", "3"])
    assert [r[0] for r in first] == [0, 0] and "exiting at iteration 3" in first[0][2]
    second = _program_on(2, base + ["--metrics-file", resumed, "--save", ckpt, "--load", ckpt])
    assert [r[0] for r in second] == [0, 0], second[0][1]
    keys = ("iteration", "consumed_samples", "global_batch_size", "lr", "lm loss")
    assert [[r[k] for k in keys] for r in _records(resumed)] == \
        [[r[k] for k in keys] for r in _records(whole)]
