"""DeepSpeed's checkpoint files load where the `deepspeed` package is not installed.

Real DeepSpeed (one forked gloo rank) saves the MLP of tests/deepspeed_parity_script.py at
ZeRO 1 and 3: their optimizer files pickle DeepSpeed's LossScaler, ZeroStageEnum and
fragment_address. Another forked rank, which drops deepspeed from sys.modules and cannot
import it again (a sys.meta_path blocker), then reads both tags with gigatron's reader and
loads the ZeRO 1 one through the engine's load_checkpoint: the weights, the step count, the
loss scale and client_state are DeepSpeed's.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("deepspeed", reason="the real DeepSpeed writes the checkpoints: "
                    "DS_BUILD_OPS=0 pip install deepspeed==0.19.8")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from multirank import run_on_ranks  # noqa: E402

STAGES = (1, 3)
STEPS = 2


class NoDeepSpeed:
    """A sys.meta_path finder under which `import deepspeed` (and its submodules) fails."""

    def find_spec(self, name, path=None, target=None):
        if name == "deepspeed" or name.startswith("deepspeed."):
            raise ImportError(f"No module named {name!r} (blocked by the test)")


def _load_without_deepspeed(rank, world, folder):
    """In a forked rank that forgets deepspeed and cannot import it: gigatron's reader of
    each stage's save, and the engine's load_checkpoint of the first stage's."""
    for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
        del sys.modules[name]
    sys.meta_path.insert(0, NoDeepSpeed())
    with pytest.raises(ImportError):
        import deepspeed  # noqa: F401
    import gigatron
    from deepspeed_parity_script import SmallNet, ds_config, merge
    from gigatron.training.checkpoint.deepspeed import reader

    out = {}
    for stage in STAGES:
        ckpt = reader.read(os.path.join(folder, f"z{stage}", f"global_step{STEPS}"))
        out[stage] = {"read": {n: t.flatten().tolist() for n, t in ckpt.weights.items()},
                      "states": sorted(ckpt.states), "loss_scale": ckpt.loss_scale}
    model = SmallNet()
    config = merge(ds_config(STAGES[0]), {"train_batch_size": 4,
                                          "gradient_accumulation_steps": 1})
    engine, _, _, _ = gigatron.initialize(model=model, model_parameters=model.parameters(),
                                          config=config)
    _, client = engine.load_checkpoint(os.path.join(folder, f"z{STAGES[0]}"))
    out["engine"] = {"loaded": {n: p.detach().flatten().tolist()
                                for n, p in model.named_parameters()},
                     "client": client, "steps": engine.global_steps}
    out["deepspeed imported"] = "deepspeed" in sys.modules
    return out


def _save_with_deepspeed(rank, world, folder):
    """DeepSpeed trains STEPS steps per stage and saves; returns its weights by name."""
    import deepspeed
    import torch
    from deepspeed_parity_script import SmallNet, ds_config, merge, micro_batch

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the parity script
    saved = {}
    for stage in STAGES:
        torch.manual_seed(stage)
        model = SmallNet()
        config = merge(ds_config(stage), {"train_batch_size": 4,
                                          "gradient_accumulation_steps": 1})
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config)
        for step in range(STEPS):
            engine.backward(engine(*micro_batch(0, step)))
            engine.step()
        engine.save_checkpoint(os.path.join(folder, f"z{stage}"), client_state={"run": stage})
        params = list(model.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=stage == 3):
            saved[stage] = {n: p.detach().flatten().tolist() for n, p in model.named_parameters()}
        engine.destroy()
    return saved


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("deepspeed_saves"))
    (weights,) = run_on_ranks(_save_with_deepspeed, 1, folder)
    return folder, weights


def test_zero_checkpoints_load_with_deepspeed_not_importable(saved):
    folder, weights = saved
    (out,) = run_on_ranks(_load_without_deepspeed, 1, folder)
    assert out.pop("deepspeed imported") is False
    for stage in STAGES:
        got = out[stage]
        assert got["read"] == weights[stage]
        assert got["states"] == ["exp_avg", "exp_avg_sq"]
        assert got["loss_scale"] == {"scale": 1.0}  # the pickled LossScaler's cur_scale
    engine = out["engine"]
    assert engine["loaded"] == weights[STAGES[0]]
    assert engine["client"]["run"] == STAGES[0] and engine["steps"] == STEPS


def test_deepspeed_enums_are_their_values_and_objects_keep_their_attributes():
    """DeepSpeed's fp16 scaler (DeepSpeed refuses fp16 on this CPU, so no save holds one)."""
    import io
    import pickle

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from gigatron.training.checkpoint.deepspeed.pickled import DeepSpeedPickle

    scaler = DynamicLossScaler(init_scale=2 ** 12, scale_window=2, min_scale=1,
                               delayed_shift=2, consecutive_hysteresis=False)
    scaler.cur_iter = 7
    data = pickle.dumps({"zero_stage": ZeroStageEnum.gradients, "loss_scaler": scaler})
    loaded = DeepSpeedPickle.Unpickler(io.BytesIO(data)).load()
    assert loaded["zero_stage"] == 2 and type(loaded["zero_stage"]) is int
    got = loaded["loss_scaler"]
    assert type(got).__name__ == "DynamicLossScaler" and type(got) is not DynamicLossScaler
    assert (got.cur_scale, got.cur_iter, got.scale_window) == (4096, 7, 2)
