"""More ways into and out of a torch_dist checkpoint, on 2 forked ranks each.

- Resharding is exact: a checkpoint loaded into another layout and saved again at once
  (no step between) holds bit-identical global tensors -- weights, fp32 masters, Adam
  moments -- and the same step count, loss scaler and progress: virtual pipeline stages
  with ZeRO 0 -> none with ZeRO 3; ZeRO 3 -> tp2 with ZeRO 0 in bf16; fp16 with its dynamic
  loss scaler from ZeRO 2 to tp2 with ZeRO 1.
- --async-save: a run that saves in the background resumes exactly (same layout, losses
  bit for bit).
- The per-rank torch format still resumes exactly in its own layout, whatever
  --ckpt-format says now (the format is read from the folder).
- A single-device state dict written by save_global_model (what a converter writes) loads
  into tp2 and trains as the original checkpoint does.
"""
import json

import pytest
import torch

from test_training_loop import FLAGS, _program_on

from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint.torch_dist import save_load as dist

BASE = FLAGS + ["--num-layers", "4", "--eval-iters", "0", "--num-workers", "0"]


def run(world, argv):
    results = _program_on(world, argv, timeout=300)
    assert [r[0] for r in results] == [0] * world, results[0][1]
    return results[0][2]


def everything(root):
    """Every global tensor and object of the tracked torch_dist checkpoint of `root`."""
    _, folder = files.find_checkpoint(root)
    state = {name: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             if hasattr(md, "size") else None for name, md in dist.entries(folder).items()}
    return dist.read(folder, state)


def train_losses(path):
    with open(path) as f:
        return {r["iteration"]: r["lm loss"] for r in map(json.loads, f)
                if r["type"] == "train"}


@pytest.mark.parametrize("saved_as,loaded_as,masters", [
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--zero-stage", "0"], ["--zero-stage", "3"], False),
    (["--zero-stage", "3", "--bf16"], ["--tensor-model-parallel-size", "2", "--zero-stage",
                                       "0", "--bf16"], True),
    (["--zero-stage", "2", "--fp16", "--initial-loss-scale", "256"],
     ["--tensor-model-parallel-size", "2", "--zero-stage", "1", "--fp16",
      "--initial-loss-scale", "256"], True),
], ids=["vpp-zero0-to-dp2-zero3", "bf16-zero3-to-tp2-zero0", "fp16-zero2-to-tp2-zero1"])
def test_loading_into_another_layout_and_saving_again_changes_no_bit(tmp_path, saved_as,
                                                                      loaded_as, masters):
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    run(2, BASE + saved_as + ["--train-iters", "3", "--save", first])
    run(2, BASE + loaded_as + ["--train-iters", "3", "--load", first, "--save", second])
    a, b = everything(first), everything(second)
    tensors = sorted(k for k, v in a.items() if isinstance(v, torch.Tensor))
    assert tensors == sorted(k for k, v in b.items() if isinstance(v, torch.Tensor))
    assert any(k.startswith("optimizer.exp_avg_sq.") for k in tensors)
    assert any(k.startswith("optimizer.master.") for k in tensors) == masters
    for name in tensors:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    ca, cb = a["common"], b["common"]
    assert ca["progress"] == cb["progress"] and ca["progress"]["iteration"] == 3
    oa, ob = ca["optimizer"], cb["optimizer"]
    assert float(oa["scalars"]["step"]) == float(ob["scalars"]["step"]) > 0
    assert (oa["scaler"], oa["skipped_steps"]) == (ob["scaler"], ob["skipped_steps"])


def test_a_run_saving_in_the_background_resumes_exactly(tmp_path):
    # 2 layers, not BASE's 4: half the tp all-reduces of its 10 steps (3.0 -> 2.3 CPU-s)
    tp2 = BASE + ["--num-layers", "2", "--tensor-model-parallel-size", "2", "--train-iters", "5"]
    whole = str(tmp_path / "whole.jsonl")
    run(2, tp2 + ["--metrics-file", whole])
    ckpt, resumed = str(tmp_path / "ckpt"), str(tmp_path / "resumed.jsonl")
    out = run(2, tp2 + ["--async-save", "--save", ckpt, "--save-interval", "1",
                        "--exit-interval", "3", "--metrics-file", resumed])
    for iteration in (1, 2, 3):  # each save finished before the next began, and was logged
        assert f"saved checkpoint at iteration {iteration:7d}" in out, out
    assert "in the background" in out
    assert files.read_tracker(ckpt) == 3
    run(2, tp2 + ["--async-save", "--load", ckpt, "--metrics-file", resumed])
    assert train_losses(resumed) == train_losses(whole)  # bit for bit: same layout, fp32


def test_the_per_rank_torch_format_still_resumes_exactly_in_its_layout(tmp_path):
    """The uninterrupted run saves at 2 as it goes (as a run stopped there saves: one world
    less); the run resumed from there logs its losses 3 and 4."""
    dp2 = BASE + ["--zero-stage", "1", "--train-iters", "4"]
    whole, ckpt = str(tmp_path / "whole.jsonl"), str(tmp_path / "ckpt")
    run(2, dp2 + ["--ckpt-format", "torch", "--save", ckpt, "--save-interval", "2",
                  "--metrics-file", whole])
    assert dist.checkpoint_format(files.read_metadata(files.iteration_dir(ckpt, 2))) == "torch"
    resumed = str(tmp_path / "resumed.jsonl")
    run(2, dp2 + ["--load", ckpt, "--ckpt-step", "2",  # the flag says torch_dist
                  "--metrics-file", resumed])
    expected, got = train_losses(whole), train_losses(resumed)
    assert sorted(got) == [3, 4] and got == {i: expected[i] for i in got}


def test_a_single_device_state_dict_written_by_save_global_model_loads_into_tp2(tmp_path):
    trained, converted = str(tmp_path / "trained"), str(tmp_path / "converted")
    fresh = str(tmp_path / "fresh.jsonl")  # its first loss: the untrained weights'
    run(1, BASE + ["--train-iters", "2", "--save", trained, "--metrics-file", fresh])
    weights, _ = dist.load_global_model(trained)
    assert "decoder.layers.3.mlp.linear_fc1.weight" in weights
    assert weights["embedding.word_embeddings.weight"].shape[0] == 128  # no tp padding
    dist.save_global_model(weights, converted, 0, {"source": "test"})

    def first_loss(world, extra, root):
        metrics = str(tmp_path / f"{world}-{len(extra)}.jsonl")
        run(world, BASE + extra + ["--train-iters", "1", "--load", root, "--finetune",
                                   "--metrics-file", metrics])
        return train_losses(metrics)[1]

    original = first_loss(1, [], trained)
    assert abs(first_loss(2, ["--tensor-model-parallel-size", "2"], converted) - original) \
        <= 1e-5 * abs(original)
    assert abs(train_losses(fresh)[1] - original) > 1e-3  # the loaded weights mattered
