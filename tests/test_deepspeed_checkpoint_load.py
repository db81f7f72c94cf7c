"""Checkpoints the real DeepSpeed wrote continue in gigatron's engine as in DeepSpeed itself.

tests/deepspeed_checkpoint_script.py: DeepSpeed 0.19.8 trains a small MLP for 3 steps on 1
and on 2 gloo ranks at ZeRO 0, 1, 2, 3 in fp32, at ZeRO 0, 1, 3 in bf16 and at ZeRO 2 in fp16
(dynamic loss scale), saves
(`engine.save_checkpoint`, client_state included), and continues 3 steps: the oracle. Rank 0
also converts the ZeRO 2 tag with DeepSpeed's `ds_to_universal`. Then gigatron's engine, on 1
and on 2 ranks, loads every tag of both world sizes (and the universal folder) and
continues. The global batch is the same on 1 and 2 ranks, so a step's loss averaged over
its micro-batches and ranks is comparable across world sizes.

Launches: DeepSpeed on 1 and 2 ranks at once, then gigatron on 1 and 2 ranks at once (each
launch runs every case; the ranks are started and bounded as in test_deepspeed_parity.py).
Measured: every fp32 continuation within 1.1e-7 of DeepSpeed's (ZeRO 3: summation order;
the other stages equal), bf16 ones equal; loading without the optimizer states moves the
2nd/3rd steps' losses by 1.3e-2/3.4e-2, not loading the first by 9.1e-2, so the tolerances
below catch a lost moment or a lost load.
"""
from __future__ import annotations

import os
import shutil
import sys
from typing import Dict, List

import pytest

pytest.importorskip("deepspeed", reason="the real DeepSpeed is not installed: "
                    "DS_BUILD_OPS=0 pip install deepspeed==0.19.8")

from test_deepspeed_parity import start_ranks, stop, tail  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "deepspeed_checkpoint_script.py")
sys.path.insert(0, HERE)
import deepspeed_checkpoint_script as script  # noqa: E402

WORLDS = (1, 2)
LAUNCH_TIMEOUT_S = 400  # both launches of a framework together, on a loaded 2-core box
FP32_TOLERANCE = 1e-5  # relative, per step's mean loss
BF16_TOLERANCE = 2 ** -8  # one bf16 ulp of the loss (DeepSpeed's and ours both round to it)
TOLERANCES = {"fp32": FP32_TOLERANCE, "bf16": BF16_TOLERANCE, "fp16": 2 ** -10}
FP16 = script.deepspeed_supports_fp16()
needs_fp16 = pytest.mark.skipif(
    not FP16, reason="DeepSpeed refuses fp16 on this CPU (its accelerator's is_fp16_supported() "
    "asks oneDNN, which has no fp16 here: 'Type fp16 is not supported on your device'), so it "
    "wrote no fp16 checkpoint to load")


def launch(framework: str, world: int, out_dir: str) -> List:
    """Start `world` ranks of the script, each logging to out_dir."""
    flags = ["--no-fp16"] if framework == "gigatron" and not FP16 else []
    return start_ranks(SCRIPT, [framework, out_dir] + flags, world,
                       lambda rank: os.path.join(out_dir, f"{framework}{world}.rank{rank}.log"))


def wait_all(launches: Dict[str, List]) -> None:
    """Every rank of every launch exits 0 within LAUNCH_TIMEOUT_S; else the test fails with
    the failed (or hung) ranks' output, and no rank is left running."""
    import time

    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            failed = [(name, r, proc) for name, ranks in launches.items()
                      for r, (proc, _) in enumerate(ranks) if proc.poll() not in (None, 0)]
            if failed:
                time.sleep(1)  # peers of a failed rank fail too: the first one is the cause
                pytest.fail("\n".join(f"{name} rank {r} exited with {proc.returncode}:\n"
                                      f"{tail(launches[name][r][1])}"
                                      for name, r, proc in failed))
            if all(proc.poll() == 0 for ranks in launches.values() for proc, _ in ranks):
                return
            time.sleep(0.1)
        pytest.fail("\n".join(f"{name} rank {r} did not finish within {LAUNCH_TIMEOUT_S} s "
                              f"(hung?):\n{tail(log)}" for name, ranks in launches.items()
                              for r, (_, log) in enumerate(ranks)))
    finally:
        for ranks in launches.values():
            stop(ranks)


def step_means(ranks: List[List[List]]) -> List[float]:
    """Per step, the loss averaged over every (rank, micro-batch) chunk of the global batch."""
    means = []
    for steps in zip(*ranks):
        losses = [loss for chunks in steps for _, loss in chunks]
        means.append(sum(losses) / len(losses))
    return means


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Dict[str, Dict[int, List[Dict]]]:
    """{framework: {world size: per-rank results}}; the checkpoints stay in the folder."""
    import json

    out = str(tmp_path_factory.mktemp("ds_checkpoints"))
    results: Dict[str, Dict[int, List[Dict]]] = {}
    for framework in ("deepspeed", "gigatron"):
        wait_all({f"{framework}{w}": launch(framework, w, out) for w in WORLDS})
        results[framework] = {w: [json.load(open(os.path.join(
            out, f"{framework}{w}.rank{r}.json"))) for r in range(w)] for w in WORLDS}
    results["folder"] = out  # type: ignore[assignment]
    return results


def relative(a: List[float], b: List[float]) -> float:
    assert len(a) == len(b) == script.CONTINUE, (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


CONTINUATIONS = [pytest.param(case, source, loader, marks=[needs_fp16]
                              if script.CASES[case][1] == "fp16" else [])
                 for case in script.CASES for source in WORLDS for loader in WORLDS]


@pytest.mark.parametrize("case,source,loader", CONTINUATIONS)
def test_gigatron_continues_deepspeed_checkpoint_with_deepspeeds_losses(runs, case, source,
                                                                         loader):
    oracle = step_means([rank[case]["losses"] for rank in runs["deepspeed"][source]])
    ours = step_means([rank[f"{case}@{source}"]["losses"] for rank in runs["gigatron"][loader]])
    tolerance = TOLERANCES[script.CASES[case][1]]
    assert relative(ours, oracle) <= tolerance, (
        f"{case} saved by DeepSpeed on {source} rank(s), continued by gigatron on {loader}: "
        f"{ours} vs DeepSpeed's {oracle}")


@pytest.mark.parametrize("source,loader", [(s, w) for s in WORLDS for w in WORLDS])
def test_universal_checkpoint_continues_with_deepspeeds_losses(runs, source, loader):
    case = script.UNIVERSAL_CASE
    oracle = step_means([rank[case]["losses"] for rank in runs["deepspeed"][source]])
    ours = step_means([rank[f"{case}@{source}-universal"]["losses"]
                       for rank in runs["gigatron"][loader]])
    assert relative(ours, oracle) <= FP32_TOLERANCE, (ours, oracle)


@needs_fp16
@pytest.mark.parametrize("source,loader", [(s, w) for s in WORLDS for w in WORLDS])
def test_fp16_loss_scale_carries_over_and_grows_at_deepspeeds_step(runs, source, loader):
    """The dynamic loss scale DeepSpeed saved (grown from 2^8 over the clean steps) is the
    one the loaded engine starts from, and it grows again at the continued step DeepSpeed's
    own grows at (the 2nd: DeepSpeed's rule; Megatron's would grow at the 1st and 3rd)."""
    saved = runs["deepspeed"][source][0]["z2-fp16"]["loss_scale"]
    assert saved > 2 ** script.INITIAL_SCALE_POWER
    oracle = runs["deepspeed"][source][0]["z2-fp16"]["scales"]
    assert oracle == [saved, 2 * saved, 2 * saved], oracle  # one growth inside the steps
    for rank in runs["gigatron"][loader]:
        assert rank[f"z2-fp16@{source}"]["loss_scale"] == saved
        assert rank[f"z2-fp16@{source}"]["scales"] == oracle


@pytest.mark.parametrize("loader", WORLDS)
def test_lost_optimizer_state_or_lost_checkpoint_is_told_apart(runs, loader):
    """Without the moments (or without the load) the losses move by far more than the
    tolerances: the continuation tests above can fail. Without the moments the weights still
    load: the first step's loss, taken before any update, is DeepSpeed's."""
    oracle = step_means([rank["z1"]["losses"] for rank in runs["deepspeed"][WORLDS[0]]])
    for variant, at_least in (("z1-no-optimizer", 1e-3), ("z1-not-loaded", 1e-2)):
        ours = step_means([rank[variant]["losses"] for rank in runs["gigatron"][loader]])
        assert relative(ours, oracle) > max(at_least, BF16_TOLERANCE), (variant, ours, oracle)
        first = abs(ours[0] - oracle[0]) / abs(oracle[0])
        assert (first <= FP32_TOLERANCE) == (variant == "z1-no-optimizer"), (variant, first)


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_damaged_rank_file_is_one_line_naming_it(runs, tmp_path, damage):
    """A tag whose save did not finish on every rank is refused before anything loads."""
    from gigatron.training.checkpoint.deepspeed import reader

    tag = tmp_path / "z2"
    shutil.copytree(os.path.join(runs["folder"], "ds2", "z2", f"global_step{script.SAVE_AT}"),
                    tag)
    path = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "missing":
        os.remove(path)
        expected = r"lacks the ZeRO optimizer files of dp ranks \[1\]"
    else:
        path.write_bytes(path.read_bytes()[:1000])
        expected = r"zero_pp_rank_1_mp_rank_00_optim_states.pt cannot be read .*truncated"
    with pytest.raises(ValueError, match=expected):
        reader.read(str(tag))


@pytest.mark.parametrize("case", ["z0", "z1", "z2", "z3", "z0-bf16", "z3-bf16"])
def test_to_safetensors_equals_deepspeeds_zero_to_fp32(runs, case, tmp_path):
    """`gigatron convert deepspeed-to-gigatron --to safetensors` writes what DeepSpeed's own
    zero_to_fp32 consolidates (ZeRO 0: the module's fp32 weights, as DeepSpeed loads them)."""
    import torch
    from safetensors.torch import load_file

    from gigatron.cli.convert import main

    folder = os.path.join(runs["folder"], "ds2", case)
    assert main(["deepspeed-to-gigatron", "--load", folder, "--save", str(tmp_path),
                 "--to", "safetensors"]) == 0
    ours = load_file(str(tmp_path / "model.safetensors"))
    if case.startswith("z0"):
        fp32 = torch.load(os.path.join(folder, f"global_step{script.SAVE_AT}",
                                       "mp_rank_00_model_states.pt"), weights_only=False)
        optimizer = fp32["optimizer"]
        masters = [t for group in optimizer.get("fp32_groups", []) for t in group]
        reference = dict(zip(fp32["module"], masters)) if masters else fp32["module"]
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        reference = get_fp32_state_dict_from_zero_checkpoint(folder)
    assert sorted(ours) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor.contiguous().float()), name


def test_megatron_deepspeed_gpt_converts_to_gigatron_names(runs, tmp_path):
    """A ZeRO 2 checkpoint of 2 ranks whose parameters carry Megatron-DeepSpeed GPTModel's
    names and whose client_state holds its Megatron args: every tensor lands under gigatron's
    name, equal to DeepSpeed's consolidated fp32 weights, the vocabulary cut to --vocab-size
    and padded as gigatron pads it; the optimizer state and iteration come along."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from gigatron.cli.convert import main
    from gigatron.training.checkpoint.convert import load_model

    folder = os.path.join(runs["folder"], "megatron")
    assert main(["deepspeed-to-gigatron", "--load", folder, "--save", str(tmp_path)]) == 0
    config, ours = load_model(str(tmp_path))
    assert (config.num_layers, config.hidden_size, config.vocab_size) == (2, 8, 60)
    ds = get_fp32_state_dict_from_zero_checkpoint(folder)
    renames = {"input_layernorm": "input_layernorm",
               "self_attention.query_key_value": "self_attention.linear_qkv",
               "self_attention.dense": "self_attention.linear_proj",
               "post_attention_layernorm": "pre_mlp_layernorm",
               "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
    expected = {"embedding.position_embeddings.weight":
                ds["language_model.embedding.position_embeddings.weight"],
                "decoder.final_layernorm.weight":
                ds["language_model.encoder.final_layernorm.weight"],
                "decoder.final_layernorm.bias": ds["language_model.encoder.final_layernorm.bias"]}
    for layer in range(2):
        for old, new in renames.items():
            for kind in ("weight", "bias"):
                expected[f"decoder.layers.{layer}.{new}.{kind}"] = \
                    ds[f"language_model.encoder.layers.{layer}.{old}.{kind}"]
    word = ours.pop("embedding.word_embeddings.weight")
    assert torch.equal(word[:60], ds["language_model.embedding.word_embeddings.weight"][:60])
    assert not word[60:].any()  # gigatron's own padding rows
    assert sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor), name
    check_resumable(str(tmp_path), folder)


def test_megatron_deepspeed_tp2_pp2_pipeline_save_converts_to_the_tp1_models_logits(runs,
                                                                                    tmp_path):
    """Megatron-DeepSpeed's pipeline-engine layout at tp 2 x pp 2 (ZeRO 1 over dp 2: four
    model-parallel ranks' model states and optimizer files, per-layer files per tp rank;
    tests/megatron_deepspeed_writer.py) converts to the model the same weights saved at tp 1
    convert to: logits within 1e-5, Adam's moments equal."""
    import torch

    from gigatron.models.gpt import GPTModel
    from gigatron.training.checkpoint import folders
    from gigatron.training.checkpoint.convert import load_model
    from gigatron.training.checkpoint.deepspeed.convert import deepspeed_to_gigatron
    from gigatron.training.checkpoint.torch_dist import save_load
    import megatron_deepspeed_writer as writer

    tp1, pipe = (os.path.join(runs["folder"], n) for n in ("megatron-tp1", "megatron-tp2pp2"))
    names = writer.saved_parts(pipe)
    assert "mp_rank_03_model_states.pt" in names and "zero_pp_rank_1_mp_rank_03_optim_states.pt" \
        in names and "layer_05-model_01-model_states.pt" in names, names
    logits, moments = [], []
    for source in (tp1, pipe):
        out = str(tmp_path / os.path.basename(source))
        deepspeed_to_gigatron(source, out)
        config, state = load_model(out)
        model = GPTModel(config)
        model.load_state_dict(state)
        tokens = torch.arange(32).reshape(2, 16) % config.vocab_size
        logits.append(model(tokens).detach()[..., :config.vocab_size])  # padding is -inf
        key = "optimizer.exp_avg.decoder.layers.1.self_attention.linear_qkv.weight"
        folder = folders.find_checkpoint(out)[1]
        moments.append(save_load.read(folder, {key: torch.empty(24, 8)})[key])
    assert (logits[0] - logits[1]).abs().max() <= 1e-5 * logits[0].abs().max()
    assert moments[0].abs().sum() > 0 and torch.equal(moments[0], moments[1])


def test_a_plain_pipeline_save_reads_whole_and_a_tensor_parallel_one_is_refused(runs,
                                                                                tmp_path):
    """A plain PipelineModule's save (PipeDataParallelTopology: model-parallel rank = stage,
    layer files without a tp rank), made here from tp rank 0's files of the tp2 x pp2 save,
    reads as one checkpoint of both stages; the tp2 save itself is refused for plain modules
    (no tp split is known) in one line naming the converter."""
    import torch

    from gigatron.training.checkpoint.deepspeed import reader
    import megatron_deepspeed_writer as writer

    pipe = os.path.join(runs["folder"], "megatron-tp2pp2", writer.TAG)
    with pytest.raises(ValueError, match="no tensor-parallel split") as err:
        reader.read(pipe)
    assert "\n" not in str(err.value) and "deepspeed-to-gigatron" in str(err.value)
    plain = tmp_path / writer.TAG
    plain.mkdir()
    for stage in range(writer.PP):
        mp = f"mp_rank_{stage * writer.TP:02d}"
        for name in os.listdir(pipe):
            if mp in name:
                shutil.copy(os.path.join(pipe, name),
                            plain / name.replace(mp, f"mp_rank_{stage:02d}"))
    for name in os.listdir(pipe):
        if name.startswith("layer_") and "-model_00-" in name:
            shutil.copy(os.path.join(pipe, name), plain / name.replace("-model_00-", "-"))
    whole = reader.read(str(plain))
    want = reader.read_tensor_parallel(pipe, True, writer.TP, writer.PP)[0]
    assert sorted(whole.weights) == sorted(want.weights) and "4.bias" in whole.weights
    for name, tensor in want.weights.items():
        assert torch.equal(whole.weights[name], tensor), name
        assert torch.equal(whole.states["exp_avg"][name], want.states["exp_avg"][name]), name


def check_resumable(converted: str, source: str) -> None:
    """The converted checkpoint is one pretrain_gpt.py --load resumes: the saved iteration
    (client_state's), Adam's step and moments under gigatron's names."""
    import torch

    from gigatron.training.checkpoint import folders
    from gigatron.training.checkpoint.deepspeed import reader
    from gigatron.training.checkpoint.torch_dist import save_load

    iteration, folder = folders.find_checkpoint(converted)
    assert iteration == 1 and folder is not None
    common = save_load.read_common(folder)
    assert common["progress"]["iteration"] == 1
    assert float(common["optimizer"]["scalars"]["step"]) == 1.0
    saved = reader.read(reader.tag_folder(source, None) or "")
    pairs = {"optimizer.exp_avg.decoder.layers.1.mlp.linear_fc1.weight":
             saved.states["exp_avg"]["language_model.encoder.layers.1.mlp.dense_h_to_4h.weight"],
             "optimizer.exp_avg_sq.decoder.layers.0.self_attention.linear_qkv.bias":
             saved.states["exp_avg_sq"][
                 "language_model.encoder.layers.0.self_attention.query_key_value.bias"]}
    read = save_load.read(folder, {k: torch.empty_like(v) for k, v in pairs.items()})
    for key, tensor in pairs.items():
        assert tensor.abs().sum() > 0 and torch.equal(read[key], tensor), key


def test_pipeline_names_map_by_what_each_layer_holds():
    """GPTModelPipe's `<index>.<name>` parameters (tied embedding under tied_modules.embed)
    map to Megatron-Core's names, layers numbered in index order."""
    import torch

    from gigatron.training.checkpoint.deepspeed.megatron_gpt import core_state_dict

    t = torch.zeros(1)
    pipe = {"tied_modules.embed.word_embeddings.weight": t,
            "tied_modules.embed.position_embeddings.weight": t,
            "2.input_layernorm.weight": t, "2.self_attention.query_key_value.weight": t,
            "3.input_layernorm.weight": t, "3.mlp.dense_4h_to_h.bias": t,
            "4.weight": t, "4.bias": t}
    assert sorted(core_state_dict(pipe)) == sorted([
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
        "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.linear_qkv"
        ".weight", "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.1.mlp.linear_fc2.bias", "decoder.final_layernorm.weight",
        "decoder.final_layernorm.bias"])
    untied = {"1.word_embeddings.weight": t, "2.input_layernorm.weight": t, "3.weight": t,
              "4.lm_head.weight": t}
    assert "output_layer.weight" in core_state_dict(untied)
