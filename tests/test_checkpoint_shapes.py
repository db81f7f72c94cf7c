"""--load of a checkpoint whose model differs from the flags: one error naming the parameter,
both shapes, the flags that decide them and the values that differ (no load_state_dict
traceback). In-process: the model and the checkpoint are built directly."""
from types import SimpleNamespace

import pytest
import torch

from gigatron.models.gpt import GPTModel
from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint import orchestrator as state
from gigatron.training.config.arguments import build_run_config, parse_flags
from gigatron.training.checkpoint.integrity import job_gather
from gigatron.training.checkpoint.torch_dist.save_load import save_global_model
from gigatron.training.checkpoint.torch_dist.state import placement_of

BASE = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --mock-data --vocab-size 128 "
        "--make-vocab-size-divisible-by 8 --train-iters 2").split()
GROUPS = SimpleNamespace(coords={"tp": 0, "pp": 0, "dp": 0}, rank=0)


def _run(root, changes=()):
    argv = list(BASE)
    for flag, value in changes:
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value] if value is not None else [flag]
    return build_run_config(parse_flags(argv + ["--load", root], "pretrain_gpt.py"), 1, None)


def _save(root, run, fmt="torch"):
    model = GPTModel(run.model)
    if fmt == "torch_dist":  # the single-device state, as a converter writes it
        global_state = {n: p.detach()[tuple(slice(0, k) for k in
                                            placement_of(p, 0, 1).global_shape)]
                        for n, p in model.named_parameters()}
        save_global_model(global_state, root, 3, {"flags": run.flags})
        return model
    meta = {**state.layout(run, 1), "zero_stage": 0, "flags": run.flags}
    files.save_checkpoint(root, 3, {"model": [model.state_dict()]}, GROUPS.coords, meta)
    return model


def _load_error(root, run):
    with pytest.raises(ValueError) as err:
        state.load_model_weights(run, GROUPS, [GPTModel(run.model)])
    return str(err.value)


@pytest.mark.parametrize("changes,phrases", [
    ([("--hidden-size", "64")],
     ["decoder.final_layernorm.bias has shape (32,) in the checkpoint but (64,) in this run",
      "--hidden-size is 32 in the checkpoint, 64 in this run"]),
    ([("--ffn-hidden-size", "96")],
     ["decoder.layers.0.mlp.linear_fc1.bias has shape (128,) in the checkpoint but (96,) in "
      "this run", "decided by --ffn-hidden-size, --swiglu, --hidden-size",
      "--ffn-hidden-size is unset (its default) in the checkpoint, 96 in this run"]),
    ([("--num-attention-heads", "8"), ("--num-query-groups", "2"),
      ("--group-query-attention", None)],
     ["decoder.layers.0.self_attention.linear_qkv.bias has shape (96,) in the checkpoint but "
      "(48,) in this run", "--num-query-groups is unset (its default) in the checkpoint, 2 in "
      "this run", "--num-attention-heads is 4 in the checkpoint, 8 in this run"]),
    ([("--num-layers", "3")],
     ["decoder.layers.2.input_layernorm.bias is missing from the checkpoint",
      "decided by --num-layers", "--num-layers is 2 in the checkpoint, 3 in this run"]),
    ([("--vocab-size", "200")],
     ["embedding.word_embeddings.weight has shape (128, 32) in the checkpoint but (200, 32) "
      "in this run", "--vocab-size, --tokenizer-type", "--make-vocab-size-divisible-by",
      "--vocab-size is 128 in the checkpoint, 200 in this run"]),
    ([("--max-position-embeddings", "32")],
     ["embedding.position_embeddings.weight has shape (16, 32) in the checkpoint but (32, 32) "
      "in this run", "--max-position-embeddings is unset (its default) in the checkpoint, 32 "
      "in this run"]),
    ([("--untie-embeddings-and-output-weights", None)],
     ["output_layer.weight is missing from the checkpoint",
      "decided by --untie-embeddings-and-output-weights"]),
], ids=["hidden", "ffn", "heads", "layers", "vocab", "positions", "untied"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_shape_mismatch_names_parameter_shapes_and_flags(tmp_path, changes, phrases, fmt):
    root = str(tmp_path)
    _save(root, _run(root), fmt)
    message = _load_error(root, _run(root, changes))
    assert message.startswith(f"checkpoint {files.iteration_dir(root, 3)} does not fit this "
                              f"run's model: "), message
    for phrase in phrases:
        assert phrase in message, message
    assert message.endswith("Relaunch with the checkpoint's values, or drop --load to start "
                            "from scratch"), message
    assert "Traceback" not in message and "load_state_dict" not in message


def test_many_differences_are_counted_not_listed(tmp_path):
    root = str(tmp_path)
    _save(root, _run(root))
    message = _load_error(root, _run(root, [("--hidden-size", "64")]))
    assert "; and " in message and " more parameters. These are decided by " in message
    assert message.count(" in the checkpoint but ") == 4


def test_same_flags_but_other_shapes_says_so(tmp_path):
    root = str(tmp_path)
    run = _run(root)
    model = _save(root, run)
    shard_path = files.rank_file(files.iteration_dir(root, 3), GROUPS.coords)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    weights["decoder.final_layernorm.weight"] = torch.ones(7)
    meta = {**state.layout(run, 1), "zero_stage": 0, "flags": run.flags}
    files.save_checkpoint(root, 3, {"model": [weights]}, GROUPS.coords, meta)
    assert files.read_shard(shard_path)["model"][0]["decoder.final_layernorm.weight"].shape == (7,)
    message = _load_error(root, run)
    assert ("decoder.final_layernorm.weight has shape (7,) in the checkpoint but (32,) in this "
            "run. This is decided by --hidden-size: those flags have the same values in the "
            "checkpoint and this run") in message, message


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_matching_checkpoint_loads_its_weights(tmp_path, fmt):
    root = str(tmp_path)
    run = _run(root)
    saved = _save(root, run, fmt)
    model = GPTModel(run.model, seed=99)
    assert not torch.equal(model.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"],
                           saved.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"])
    shard = state.load_model_weights(run, GROUPS, [model])
    assert shard is not None
    for (name, a), b in zip(saved.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_load_model_weights_verifies_the_shard_checksum(tmp_path):
    root = str(tmp_path)
    run = _run(root)
    _save(root, run)
    path = files.rank_file(files.iteration_dir(root, 3), GROUPS.coords)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    message = _load_error(root, run)
    assert f"checkpoint shard {path} of iteration 3 does not match the checksum" in message
    assert "no older checkpoint in" in message


def _load_with_rank_1_shard_damaged(rank, world, root):
    run = build_run_config(parse_flags(BASE + ["--load", root], "pretrain_gpt.py"), world, None)
    groups = SimpleNamespace(coords={"tp": 0, "pp": 0, "dp": rank}, rank=rank)
    meta = {**state.layout(run, 1), "zero_stage": 0, "flags": run.flags}
    files.save_checkpoint(root, 3, {"model": [GPTModel(run.model).state_dict()]}, groups.coords,
                          meta, job_gather(torch.device("cpu")), rank == 0)
    if rank == 1:
        path = files.rank_file(files.iteration_dir(root, 3), groups.coords)
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0xFF
        open(path, "wb").write(bytes(data))
    job_gather(torch.device("cpu"))([rank])  # the damage is done before anyone loads
    try:
        state.load_model_weights(run, groups, [GPTModel(run.model)])
    except ValueError as err:
        return str(err)
    return None


def test_one_damaged_shard_stops_every_rank_at_load(tmp_path):
    """Rank 1's shard fails its checksum; rank 0's loads fine but stops too instead of going
    on to wait in a collective for a rank that has stopped."""
    from multirank import run_on_ranks

    root = str(tmp_path)
    errors = run_on_ranks(_load_with_rank_1_shard_damaged, 2, root)
    folder = files.iteration_dir(root, 3)
    assert errors[0] == (f"rank 1 could not load its part of checkpoint {folder} (the error "
                         f"line of rank 1 names the file and the fix): this rank stops too")
    assert errors[1].startswith(f"checkpoint shard {folder}/mp_rank_00_000_001/model_optim_rng"
                                f".pt of iteration 3 does not match the checksum"), errors[1]
