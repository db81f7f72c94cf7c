"""The torch_dist folder keeps the torch format's guarantees: a kill -9 at any point of a
save leaves the previous checkpoint loadable; a changed, missing or truncated file is one
error naming it and the older checkpoint to fall back on; a full disk on one rank fails the
save on every rank with one message and keeps the previous checkpoint. Also: the
single-device model API (save_global_model / load_global_model) and the background saver."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint.torch_dist import save_load as dist
from gigatron.training.checkpoint.integrity import file_sha256
from gigatron.training.checkpoint.torch_dist.async_save import AsyncSaver

COORDS = {"tp": 0, "pp": 0, "dp": 0}


def _state(iteration):
    return {"model.w": torch.arange(4096.0).view(64, 64) + iteration,
            "common": {"progress": {"iteration": iteration}}}


def _save(root, iteration):
    return dist.save(root, iteration, _state(iteration), COORDS, {"tp": 1},
                     single_process=True)


def _load_w(root):
    _, folder = files.find_checkpoint(root)
    meta = files.read_metadata(folder)
    dist.verify_files(folder, meta)
    state = dist.read(folder, {"model.w": torch.empty(64, 64), "common": None})
    return state["common"]["progress"]["iteration"], state["model.w"]


def test_global_model_round_trip_keeps_names_values_and_dtypes(tmp_path):
    state = {"embedding.word_embeddings.weight": torch.randn(10, 4),
             "decoder.final_layernorm.weight": torch.rand(4, dtype=torch.bfloat16)}
    folder = dist.save_global_model(state, str(tmp_path), 7, {"source": "test"})
    assert folder == files.iteration_dir(str(tmp_path), 7)
    assert files.read_tracker(str(tmp_path)) == 7
    for where in (str(tmp_path), folder):
        back, meta = dist.load_global_model(where)
        assert back.keys() == state.keys()
        for name, tensor in state.items():
            assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
        assert meta["ckpt_format"] == "torch_dist" and meta["source"] == "test"
        assert meta["iteration"] == 7


def test_load_global_model_refuses_a_per_rank_checkpoint_naming_the_fix(tmp_path):
    files.save_checkpoint(str(tmp_path), 1, {"model": [{}]}, COORDS, {"tp": 1})
    with pytest.raises(ValueError, match="is a torch checkpoint, not torch_dist: .*save it "
                                         "again with --ckpt-format torch_dist"):
        dist.load_global_model(str(tmp_path))
    with pytest.raises(ValueError, match="holds no checkpoint"):
        dist.load_global_model(str(tmp_path / "nothing"))


def test_every_file_is_checksummed_in_metadata(tmp_path):
    folder = _save(str(tmp_path), 1)
    meta = files.read_metadata(folder)
    assert meta["ckpt_format"] == "torch_dist"
    assert sorted(meta["files"]) == sorted(n for n in os.listdir(folder)
                                           if n != files.METADATA)
    assert dist.DCP_METADATA in meta["files"]
    for name, entry in meta["files"].items():
        sha, size = file_sha256(os.path.join(folder, name))
        assert entry == {"sha256": sha, "bytes": size}


def _fallback(root, iteration=1):
    tracker = os.path.join(root, files.TRACKER)
    return (f"an older checkpoint exists, iteration {iteration} "
            f"({files.iteration_dir(root, iteration)}): to resume from it, write {iteration} "
            f"into {tracker}")


def _data_file(folder):
    return next(os.path.join(folder, n) for n in sorted(os.listdir(folder))
                if n.endswith(".distcp"))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "metadata"])
def test_a_damaged_file_is_one_error_naming_it_and_the_fallback(tmp_path, damage):
    root = str(tmp_path)
    _save(root, 1)
    folder = _save(root, 2)
    path = os.path.join(folder, dist.DCP_METADATA) if damage == "metadata" else \
        _data_file(folder)
    data = bytearray(open(path, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    if damage in ("truncate", "metadata"):
        data = data[:len(data) // 2]
    if damage == "delete":
        os.remove(path)
    else:
        open(path, "wb").write(bytes(data))
    with pytest.raises(ValueError) as err:
        _load_w(root)
    message = str(err.value)
    what = {"flip": "does not match the checksum recorded when it was saved",
            "truncate": "were written (truncated or overwritten)",
            "metadata": "were written (truncated or overwritten)",
            "delete": "is missing: the checkpoint is incomplete"}[damage]
    assert path in message and what in message and _fallback(root) in message, message
    with open(os.path.join(root, files.TRACKER), "w") as f:
        f.write("1\n")
    iteration, w = _load_w(root)  # the hint's fix works
    assert iteration == 1 and torch.equal(w, _state(1)["model.w"])


# A child saves iteration 1, then dies by SIGKILL at the point named by argv[2] while
# saving iteration 2.
CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    import torch.distributed.checkpoint as dcp
    from gigatron.training.checkpoint import folders as files
    from gigatron.training.checkpoint.torch_dist import save_load as dist

    root, where = sys.argv[1], sys.argv[2]
    state = lambda it: {"model.w": torch.arange(4096.0).view(64, 64) + it,
                        "common": {"progress": {"iteration": it}}}
    coords = {"tp": 0, "pp": 0, "dp": 0}
    dist.save(root, 1, state(1), coords, {}, single_process=True)

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "mid-write":  # DCP is writing the data
        dcp.FileSystemWriter.write_data = die
    elif where == "before-publish":  # every file written and hashed
        files.publish = die
    elif where == "before-tracker":  # folder renamed, tracker not yet replaced
        files.atomic_write_text = die
    dist.save(root, 2, state(2), coords, {}, single_process=True)
    print("not killed")
""")


@pytest.mark.parametrize("where", ["mid-write", "before-publish", "before-tracker"])
def test_kill_9_during_a_torch_dist_save_leaves_the_previous_loadable(tmp_path, where):
    root = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", CHILD, root, where], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    iteration, w = _load_w(root)
    assert iteration == 1 and torch.equal(w, _state(1)["model.w"])
    _save(root, 2)  # the next save after the crash succeeds
    assert _load_w(root)[0] == 2
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", files.TRACKER]


def _full_disk_on_rank_1(rank, world, root):
    import torch.distributed.checkpoint as dcp

    from gigatron.training.checkpoint.torch_dist.planner import ShardedValue

    coords = {"tp": rank, "pp": 0, "dp": 0}

    def sharded(it):  # each rank writes half of the rows
        value = ShardedValue((64, 64))
        value.add((32 * rank, 0), torch.full((32, 64), float(it)))
        return {"model.w": value, **({"common": {"it": it}} if rank == 0 else {})}
    dist.save(root, 1, sharded(1), coords, {})
    if rank == 1:
        def full(*_args, **_kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        dcp.FileSystemWriter.write_data = full
    try:
        dist.save(root, 2, sharded(2), coords, {})
        message = None
    except ValueError as err:
        message = str(err)
    return message


def test_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous(tmp_path):
    from multirank import run_on_ranks

    root = str(tmp_path / "ckpt")
    messages = run_on_ranks(_full_disk_on_rank_1, 2, root)
    final = files.iteration_dir(root, 2)
    for message in messages:
        assert message is not None
        assert message.startswith(f"could not save checkpoint iteration 2 to {final}: rank 1 "
                                  f"could not write its part of {final}.tmp: "), message
        assert "[Errno 28] No space left on device" in message, message
        assert f"{os.path.join(root, files.TRACKER)} still names iteration 1" in message
        assert "free space there or point --save at a disk with room" in message
    assert sorted(os.listdir(root)) == ["iter_0000001", files.TRACKER]
    folder = files.iteration_dir(root, 1)
    dist.verify_files(folder, files.read_metadata(folder))


def test_the_background_saver_returns_at_once_and_reports_at_wait():
    saver, release = AsyncSaver(), threading.Event()
    saver.start(3, 0.0, lambda: (release.wait(30), "iter_0000003")[1])
    assert saver._pending is not None and saver._pending.thread.is_alive()
    release.set()
    saved = saver.wait()
    assert (saved.iteration, saved.folder, saved.background) == (3, "iter_0000003", True)
    assert saver.wait() is None

    def fails():
        raise ValueError("could not save checkpoint iteration 4")
    saver.start(4, 0.0, fails)
    with pytest.raises(ValueError, match="could not save checkpoint iteration 4"):
        saver.wait()


def test_format_is_read_from_the_folder():
    assert dist.checkpoint_format({"ckpt_format": "torch_dist"}) == "torch_dist"
    assert dist.checkpoint_format({"shards": {"mp_rank_00_000_000/model_optim_rng.pt": {}}}) \
        == "torch"
    assert dist.checkpoint_format(
        {"shards": {"mp_rank_00_000_000/model_optim_rng.safetensors": {}}}) == "safetensors"


def test_async_save_needs_the_torch_dist_format():
    from gigatron.training.config.arguments import parse_args

    base = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
            "--mock-data --vocab-size 100 --save ckpt --async-save").split()
    with pytest.raises(ValueError, match=r"--async-save needs --ckpt-format torch_dist "
                                         r"\(got torch\): drop --ckpt-format or --async-save"):
        parse_args(base + ["--ckpt-format", "torch"], 1)
    run = parse_args(base, 1)
    assert run.checkpoint.async_save and run.checkpoint.ckpt_format == "torch_dist"
