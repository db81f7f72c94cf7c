"""A tiny MoE GPT pretrained on one CPU rank (forked, not torchrun): the log line and the
metrics file carry the balancing losses and each MoE layer's imbalance, the LM loss falls,
the expert bias moves once per step (only with its flag), no step reads the host, and
TensorBoard and `gigatron plot` show the MoE series."""
import json
import os
import sys

from multirank import run_on_ranks

from gigatron.training.observe.host_syncs import HostSyncCounter

MOE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 "
       "--micro-batch-size 4 --global-batch-size 8 --lr 3e-3 --mock-data --vocab-size 128 "
       "--eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 --init-method-std 0.1 "
       "--disable-bias-linear --swiglu --num-experts 4 --moe-aux-loss-coeff 0.01 "
       "--moe-z-loss-coeff 0.001").split()
BIAS = "--moe-router-enable-expert-bias --moe-router-score-function sigmoid".split()


def _pretrain(rank, world, argv):
    from gigatron.training.run import pretrain

    assert pretrain.main(argv) == 0


def _train_records(path):
    with open(path) as f:
        return [r for r in map(json.loads, f) if r["type"] == "train"]


def test_tiny_moe_gpt_logs_balancing_losses_and_imbalance_and_learns(tmp_path, capfd):
    metrics = str(tmp_path / "metrics.jsonl")
    argv = MOE + ["--train-iters", "30", "--log-interval", "1", "--metrics-file", metrics,
                  "--moe-expert-capacity-factor", "1.0"]
    run_on_ranks(_pretrain, 1, argv)
    out = capfd.readouterr().out
    assert "| load_balancing_loss: " in out and "| z_loss: " in out
    assert "tokens per expert max/mean (worst MoE layer): " in out and "dropped tokens: " in out
    records = _train_records(metrics)
    assert [r["iteration"] for r in records] == list(range(1, 31))
    for r in records:
        # Megatron's logged value: the switch loss without its coefficient, ~1 when balanced
        assert 0.9 < r["load_balancing_loss"] < 2.0, r
        assert r["z_loss"] > 0
        layers = r["moe"]
        assert set(layers) == {f"layer_{n}/{kind}" for n in (0, 1) for kind in (
            "tokens_per_expert_max_over_mean", "dropped_token_share")}
        assert all(v >= 1.0 for k, v in layers.items() if k.endswith("mean"))
        assert all(0.0 <= v < 1.0 for k, v in layers.items() if k.endswith("share"))
        assert r["tokens_per_expert_max_over_mean"] == max(
            v for k, v in layers.items() if k.endswith("mean"))
    assert any(v > 0 for r in records for k, v in r["moe"].items() if k.endswith("share"))
    losses = [r["lm loss"] for r in records]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05, losses


def test_dropless_runs_log_no_dropped_share(tmp_path):
    metrics = str(tmp_path / "metrics.jsonl")
    run_on_ranks(_pretrain, 1, MOE + ["--train-iters", "2", "--log-interval", "2",
                                      "--metrics-file", metrics])
    (record,) = _train_records(metrics)
    assert "dropped_token_share" not in record and set(record["moe"]) == {
        "layer_0/tokens_per_expert_max_over_mean", "layer_1/tokens_per_expert_max_over_mean"}


def _watch_expert_bias(rank, world, argv):
    """(biases after each step, update calls) of a run; the update is wrapped, not replaced."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from gigatron.models.moe import stats
    from gigatron.training.run import loop, pretrain

    real_update, snapshots, chunks = stats.update_expert_biases, [], []

    def update(model_chunks, group=None):
        real_update(model_chunks, group)
        snapshots.append([layer.router.expert_bias.clone().tolist()
                          for layer in stats.moe_layers(model_chunks)])

    real_train = loop.train

    def train(session, progress):
        chunks.extend(session.chunks)
        return real_train(session, progress)

    stats.update_expert_biases, loop.train = update, train
    assert pretrain.main(argv) == 0
    biases = [layer.router.expert_bias for layer in stats.moe_layers(chunks)]
    return snapshots, [None if b is None else b.tolist() for b in biases]


def test_expert_bias_moves_once_per_step_only_with_its_flag():
    argv = MOE + ["--train-iters", "3", "--log-interval", "3",
                  "--moe-router-bias-update-rate", "0.01"]
    snapshots, final = run_on_ranks(_watch_expert_bias, 1, argv + BIAS)[0]
    assert len(snapshots) == 3  # one update per optimizer step
    for step, layers in enumerate(snapshots, 1):
        for bias in layers:  # each step moves every expert by -rate, 0 or +rate
            assert all(abs(b) <= 0.01 * step + 1e-9 for b in bias)
            assert all(abs(round(b / 0.01) - b / 0.01) < 1e-4 for b in bias)
    assert any(b != 0 for b in snapshots[0][0])  # the first step already moved it
    assert final == snapshots[-1]
    snapshots, final = run_on_ranks(_watch_expert_bias, 1, argv + [
        "--moe-router-score-function", "sigmoid"])[0]
    assert snapshots == [] and final == [None, None]


def _count_moe_train_syncs(rank, world, argv):
    from gigatron.training.run import loop, pretrain

    counter = HostSyncCounter()

    def pausing(fn):
        def run(*args, **kwargs):
            with counter.paused():
                return fn(*args, **kwargs)
        return run

    for name in ("_log", "_evaluate_and_log", "_save"):
        setattr(loop, name, pausing(getattr(loop, name)))
    real_train = loop.train

    def counted_train(session, progress):
        with counter:
            return real_train(session, progress)
    loop.train = counted_train
    assert pretrain.main(argv) == 0
    return counter.count, dict(counter.sites)


def test_moe_steps_between_log_lines_make_no_host_sync():
    """Neither the balancing losses, the statistics nor the expert-bias update read the
    host during a step; the only reads are the routed experts' loop, which needs the token
    counts on the host to split the rows (models/moe/experts.py says so; the grouped matmul,
    where the device has one, does not)."""
    argv = MOE + BIAS + ["--train-iters", "6", "--log-interval", "3",
                         "--moe-expert-capacity-factor", "1.0"]
    count, sites = run_on_ranks(_count_moe_train_syncs, 1, argv)[0]
    assert count > 0 and all(site.startswith("tolist at ") and "/models/moe/experts.py:"
                             in site for site in sites), sites


def test_tensorboard_and_plot_show_the_moe_series(tmp_path, monkeypatch):
    from gigatron.training.observe import logger as logger_module
    from gigatron.training.observe.plot import plot_metrics, read_metrics

    scalars = {}

    class Writer:
        def add_scalar(self, key, value, step):
            scalars[key] = value

        def close(self):
            pass

    monkeypatch.setattr(logger_module, "_tensorboard_writer", lambda folder: Writer())
    metrics = str(tmp_path / "metrics.jsonl")
    log = logger_module.MetricsLogger(True, 2, metrics, str(tmp_path / "tb"), progress=False)
    for it in (1, 2):
        log.train({"iteration": it, "lm loss": 5.0, "lr": 1e-3, "load_balancing_loss": 1.1,
                   "z_loss": 2.0, "tokens_per_expert_max_over_mean": 1.5,
                   "moe": {"layer_0/tokens_per_expert_max_over_mean": 1.5,
                           "layer_1/tokens_per_expert_max_over_mean": 1.2}})
    log.close()
    assert scalars["load_balancing_loss"] == 1.1 and scalars["z_loss"] == 2.0
    assert scalars["moe/layer_1/tokens_per_expert_max_over_mean"] == 1.2
    written = plot_metrics(read_metrics(metrics), str(tmp_path / "plots"))
    names = {os.path.basename(p) for p in written}
    assert {"moe_losses.png", "moe_imbalance.png"} <= names and "moe_dropped.png" not in names
