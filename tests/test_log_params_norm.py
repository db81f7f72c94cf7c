"""--log-params-norm: Megatron's 'params norm' (the L2 norm of the fp32 master weights, each
element of the model once) on the console line, the metrics file and TensorBoard."""
import contextlib
import io
import json


from multirank import run_on_ranks

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data "
         "--vocab-size 64 --log-interval 1 --no-progress --hidden-dropout 0 "
         "--attention-dropout 0 --log-params-norm --log-optimizer-states-to-tensorboard "
         "--log-memory-to-tensorboard").split()


def _main(rank, world, argv):
    from gigatron.training.run import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = pretrain.main(argv)
    return code, out.getvalue()


def test_params_norm_is_the_master_weights_l2_norm_on_every_log_line(tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    [(code, out)] = run_on_ranks(_main, 1, FLAGS + ["--metrics-file", metrics], timeout=240)
    assert code == 0, out[-2000:]
    with open(metrics) as f:
        train = [r for r in map(json.loads, f) if r["type"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2]
    for r in train:  # the same collective as the optimizer-state series, whose tests check it
        assert r["params norm"] == r["optimizer"]["weight_l2"] > 0
    assert train[0]["params norm"] != train[1]["params norm"]  # the weights moved
    assert out.count("params norm: ") == 2, out[-2000:]
