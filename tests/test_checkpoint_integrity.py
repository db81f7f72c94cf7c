"""Checkpoint faults are never silent: a shard whose bytes changed, a truncated shard or
metadata.json, a full disk during a save. Each is one error naming the file and the
iteration, and each leaves the last good checkpoint loadable with the state it saved."""
import errno
import hashlib
import json
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

from gigatron.training.checkpoint import folders as files

COORDS = {"tp": 0, "pp": 0, "dp": 0}
META = {"tp": 1, "pp": 1, "dp": 1, "virtual_chunks": 1}


def _state(iteration):
    return {"iteration": iteration, "model": [{"w": torch.arange(1024.0) + iteration}]}


def _save_two(root, fmt="torch"):
    """Iterations 1 and 2 saved; returns iteration 2's shard path."""
    for it in (1, 2):
        files.save_checkpoint(root, it, _state(it), COORDS, META, fmt=fmt)
    return files.rank_file(files.iteration_dir(root, 2), COORDS, fmt)


def _load(root, fmt="torch"):
    """What --load does with the tracked checkpoint: metadata, then the verified shard."""
    _, folder = files.find_checkpoint(root)
    return files.read_shard(files.rank_file(folder, COORDS, fmt), fmt,
                            files.read_metadata(folder))


def _overwrite_element(path, tensor, index, value):
    """Overwrite one float32 of `tensor`'s bytes inside the file: it still deserialises."""
    data = bytearray(open(path, "rb").read())
    start = bytes(data).find(tensor.numpy().tobytes())
    assert start >= 0, "tensor bytes not found in the file"
    offset = start + 4 * index
    data[offset:offset + 4] = np.float32(value).tobytes()
    open(path, "wb").write(bytes(data))


def _expect_fallback(message, root, iteration):
    tracker = os.path.join(root, files.TRACKER)
    assert (f"an older checkpoint exists, iteration {iteration} "
            f"({files.iteration_dir(root, iteration)}): to resume from it, write {iteration} "
            f"into {tracker} (echo {iteration} > {tracker})") in message, message


def _follow_fallback_and_check_state(root, fmt="torch"):
    """The hint's fix works: the older checkpoint loads (checksum verified) as saved."""
    with open(os.path.join(root, files.TRACKER), "w") as f:
        f.write("1\n")
    shard = _load(root, fmt)
    assert shard["iteration"] == 1
    assert torch.equal(shard["model"][0]["w"], _state(1)["model"][0]["w"])


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_checksum_is_of_the_bytes_written_and_recorded_in_metadata(tmp_path, fmt):
    path = _save_two(str(tmp_path), fmt)
    meta = files.read_metadata(files.iteration_dir(str(tmp_path), 2))
    entry = meta["shards"][os.path.relpath(path, files.iteration_dir(str(tmp_path), 2))]
    raw = open(path, "rb").read()
    assert entry == {"sha256": hashlib.sha256(raw).hexdigest(), "bytes": len(raw)}
    assert meta["format_version"] == 2


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_changed_bytes_in_a_shard_are_refused_naming_file_iteration_and_checksums(tmp_path,
                                                                                   fmt):
    root = str(tmp_path)
    path = _save_two(root, fmt)
    expected = hashlib.sha256(open(path, "rb").read()).hexdigest()
    _overwrite_element(path, _state(2)["model"][0]["w"], 512, 4e33)
    actual = hashlib.sha256(open(path, "rb").read()).hexdigest()
    # without the checksum the damage loads silently (what the issue reported)
    assert files.read_shard(path, fmt)["model"][0]["w"][512].item() == pytest.approx(4e33)
    with pytest.raises(ValueError) as err:
        _load(root, fmt)
    message = str(err.value)
    assert (f"checkpoint shard {path} of iteration 2 does not match the checksum recorded when "
            f"it was saved (its bytes changed): "
            f"{os.path.join(files.iteration_dir(root, 2), 'metadata.json')} expects sha256 "
            f"{expected}, the file has {actual}; refusing to load it") in message, message
    _expect_fallback(message, root, 1)
    _follow_fallback_and_check_state(root, fmt)


def test_checkpoint_saved_before_checksums_still_loads(tmp_path):
    root = str(tmp_path)
    _save_two(root)
    meta_path = os.path.join(files.iteration_dir(root, 2), files.METADATA)
    meta = json.load(open(meta_path))
    del meta["shards"]
    meta["format_version"] = 1
    json.dump(meta, open(meta_path, "w"))
    assert torch.equal(_load(root)["model"][0]["w"], _state(2)["model"][0]["w"])


def test_truncated_shard_with_checksum_names_sizes_and_older_checkpoint(tmp_path):
    root = str(tmp_path)
    path = _save_two(root)
    size = os.path.getsize(path)
    os.truncate(path, size // 2)
    with pytest.raises(ValueError) as err:
        _load(root)
    message = str(err.value)
    assert (f"checkpoint shard {path} of iteration 2 has {size // 2} bytes but {size} were "
            f"written (truncated or overwritten)") in message, message
    _expect_fallback(message, root, 1)
    _follow_fallback_and_check_state(root)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_truncated_shard_without_checksum_names_file_iteration_and_older_checkpoint(tmp_path,
                                                                                     fmt):
    root = str(tmp_path)
    path = _save_two(root, fmt)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ValueError) as err:
        files.read_shard(path, fmt)  # as for a checkpoint written before checksums
    message = str(err.value)
    assert f"checkpoint shard {path} of iteration 2 cannot be read (" in message, message
    assert "): the file is truncated or damaged; " in message, message
    _expect_fallback(message, root, 1)
    _follow_fallback_and_check_state(root, fmt)


@pytest.mark.parametrize("damage", [b'{"format_version": 2, "itera', b"\xff\xfe\x00garbage",
                                    b"", b"[1, 2]"], ids=["truncated", "binary", "empty", "list"])
def test_damaged_metadata_names_file_iteration_and_older_checkpoint(tmp_path, damage):
    root = str(tmp_path)
    _save_two(root)
    meta_path = os.path.join(files.iteration_dir(root, 2), files.METADATA)
    open(meta_path, "wb").write(damage)
    with pytest.raises(ValueError) as err:
        _load(root)
    message = str(err.value)
    assert f"{meta_path} of checkpoint iteration 2 " in message, message
    assert ("is not valid JSON (" in message or "holds a list, not an object" in message), message
    assert "the file is truncated or damaged" in message or "the file is damaged" in message
    _expect_fallback(message, root, 1)
    _follow_fallback_and_check_state(root)


def test_no_older_checkpoint_is_said_plainly(tmp_path):
    root = str(tmp_path)
    files.save_checkpoint(root, 1, _state(1), COORDS, META)
    meta_path = os.path.join(files.iteration_dir(root, 1), files.METADATA)
    open(meta_path, "w").write("{")
    with pytest.raises(ValueError, match=f"no older checkpoint in {root} to fall back on"):
        _load(root)


def _world_state(iteration, rank):
    return {"iteration": iteration, "rank": rank,
            "model": [{"w": torch.full((64, 64), float(10 * iteration + rank))}]}


def _fail_like_a_full_disk(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _save_with_a_full_disk_on_one_rank(rank, world, root, where):
    """Iteration 1 saves; iteration 2 fails on one rank only. Returns (this rank's error,
    the iteration and state the tracked checkpoint then loads)."""
    from gigatron.training.checkpoint.integrity import job_gather

    gather = job_gather(torch.device("cpu"))
    coords = {"tp": rank, "pp": 0, "dp": 0}
    meta = {"tp": world, "pp": 1, "dp": 1, "virtual_chunks": 1}
    files.save_checkpoint(root, 1, _world_state(1, rank), coords, meta, gather, rank == 0)
    if where == "shard" and rank == 1:  # some bytes reach the disk, then it is full
        def torch_save(obj, f):
            f.write(b"\x80" * 100)
            _fail_like_a_full_disk()
        torch.save = torch_save
    if where == "metadata" and rank == 0:
        json.dump = _fail_like_a_full_disk
    try:
        files.save_checkpoint(root, 2, _world_state(2, rank), coords, meta, gather, rank == 0)
        message = None
    except ValueError as err:
        message = str(err)
    gather([rank])  # every rank got here: none is left waiting in a collective
    _, folder = files.find_checkpoint(root)
    shard = files.read_shard(files.rank_file(folder, coords), "torch",
                             files.read_metadata(folder))
    return message, shard["iteration"], torch.equal(shard["model"][0]["w"],
                                                    _world_state(1, rank)["model"][0]["w"])


@pytest.mark.parametrize("where", ["shard", "metadata"])
def test_full_disk_on_one_rank_fails_the_save_on_every_rank_and_keeps_the_previous(tmp_path,
                                                                                   where):
    from multirank import run_on_ranks

    root = str(tmp_path / "ckpt")
    results = run_on_ranks(_save_with_a_full_disk_on_one_rank, 2, root, where)
    final = files.iteration_dir(root, 2)
    failing = (f"rank 1 could not write its shard {final}.tmp/mp_rank_01_000_000/"
               f"model_optim_rng.pt" if where == "shard" else f"rank 0 could not publish {final}")
    needed = 2 * 64 * 64 * 4
    for rank, (message, iteration, same) in enumerate(results):
        assert message is not None, f"rank {rank} did not fail"
        assert message.startswith(f"could not save checkpoint iteration 2 to {final}: "
                                  f"{failing}: "), message
        assert "[Errno 28] No space left on device; " in message, message
        assert (f"the checkpoint needs about 32.0 KiB = {needed} bytes (an estimate: the bytes "
                f"of the tensors being saved, summed over all ranks) and {root} had ") in message
        assert " bytes free when the write failed. " in message, message
        assert (f"The partial folder {final}.tmp was removed and "
                f"{os.path.join(root, files.TRACKER)} still names iteration 1, which stays "
                f"loadable: free space there or point --save at a disk with room, then resume "
                f"with --load {root}") in message, message
        assert (iteration, same) == (1, True)
    assert sorted(os.listdir(root)) == ["iter_0000001", files.TRACKER]
    assert open(os.path.join(root, files.TRACKER)).read().strip() == "1"


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root only); skips where mounting is not permitted; always unmounted."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
                       check=True, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    try:
        yield str(disk)
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_a_really_full_disk_fails_cleanly_and_keeps_the_previous_checkpoint(small_disk, fmt):
    root = os.path.join(small_disk, "ckpt")
    files.save_checkpoint(root, 1, _state(1), COORDS, META, fmt=fmt)
    big = {"iteration": 2, "model": [{"w": torch.ones(128, 1024)}]}  # 512 KiB > the disk
    with pytest.raises(ValueError) as err:
        files.save_checkpoint(root, 2, big, COORDS, META, fmt=fmt)
    message = str(err.value)
    assert f"could not save checkpoint iteration 2 to {files.iteration_dir(root, 2)}: rank 0 " \
           f"could not write its shard" in message, message
    assert "No space left on device" in message, message
    assert "the checkpoint needs about 512.0 KiB = 524288 bytes (an estimate" in message, message
    assert " bytes free when the write failed" in message, message
    assert "still names iteration 1, which stays loadable" in message, message
    assert sorted(os.listdir(root)) == ["iter_0000001", files.TRACKER]
    shard = _load(root, fmt)
    assert torch.equal(shard["model"][0]["w"], _state(1)["model"][0]["w"])
    # the partial folder's space came back: a save that fits succeeds
    files.save_checkpoint(root, 2, _state(2), COORDS, META, fmt=fmt)
    assert _load(root, fmt)["iteration"] == 2


def _main_with_a_full_disk_at_the_second_save_of_rank_1(rank, world, argv, fmt):
    import torch.distributed.checkpoint as dcp

    from gigatron.training.checkpoint.integrity import HashingWriter
    from test_training_loop import _main

    if rank == 1 and fmt == "torch":
        real_save, shards = torch.save, []

        def torch_save(obj, f, *args, **kwargs):
            if isinstance(f, HashingWriter):
                shards.append(f)
                if len(shards) == 2:
                    _fail_like_a_full_disk()
            return real_save(obj, f, *args, **kwargs)
        torch.save = torch_save
    if rank == 1 and fmt == "torch_dist":
        real_write, calls = dcp.FileSystemWriter.write_data, []

        def write_data(self, plan, planner):
            calls.append(plan)
            if len(calls) == 2:
                _fail_like_a_full_disk()
            return real_write(self, plan, planner)
        dcp.FileSystemWriter.write_data = write_data
    return _main(rank, world, argv)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_full_disk_during_training_stops_every_rank_with_one_line_keeping_the_last_save(
        tmp_path, fmt):
    """The whole program: the loop's save fails on rank 1 only; both ranks exit 2 through
    main's handler with the message (no traceback, no hang) and the tracker names the last
    good checkpoint."""
    import sys

    from multirank import run_on_ranks
    from test_training_loop import FLAGS

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ckpt = str(tmp_path / "ckpt")
    argv = FLAGS + ["--train-iters", "4", "--save", ckpt, "--save-interval", "2",
                    "--eval-iters", "0", "--ckpt-format", fmt]
    results = run_on_ranks(_main_with_a_full_disk_at_the_second_save_of_rank_1, 2, argv, fmt)
    assert [r[0] for r in results] == [2, 2], results
    part = "its shard " if fmt == "torch" else "its part of "
    for rank, (_, err, _) in enumerate(results):
        assert (f"pretrain_gpt.py: error (rank {rank}): could not save checkpoint iteration 4 "
                f"to {files.iteration_dir(ckpt, 4)}: rank 1 could not write {part}") in err
        assert "No space left on device" in err and "still names iteration 2" in err, err
        assert "Traceback" not in err, err
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", files.TRACKER]
    assert open(os.path.join(ckpt, files.TRACKER)).read().strip() == "2"


def test_an_unwritable_save_folder_is_named_with_its_fix(tmp_path, monkeypatch):
    root = str(tmp_path / "ckpt")
    files.save_checkpoint(root, 1, _state(1), COORDS, META)

    def denied(*_args, **_kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    monkeypatch.setattr(torch, "save", denied)
    with pytest.raises(ValueError) as err:
        files.save_checkpoint(root, 2, _state(2), COORDS, META)
    message = str(err.value)
    assert "rank 0 could not write its shard " in message, message
    assert "PermissionError: [Errno 13] Permission denied" in message, message
    assert f"make {root} writable or point --save at a folder this job may write" in message
    assert sorted(os.listdir(root)) == ["iter_0000001", files.TRACKER]


def test_a_really_full_disk_fails_a_torch_dist_save_cleanly(small_disk):
    from gigatron.training.checkpoint.torch_dist import save_load as dist

    root = os.path.join(small_disk, "ckpt")
    dist.save(root, 1, {"model.w": torch.ones(16, 16)}, COORDS, {}, single_process=True)
    with pytest.raises(ValueError) as err:  # 512 KiB > the disk
        dist.save(root, 2, {"model.w": torch.ones(128, 1024)}, COORDS, {},
                  single_process=True)
    message = str(err.value)
    assert f"could not save checkpoint iteration 2 to {files.iteration_dir(root, 2)}: rank 0 " \
           f"could not write its part of" in message, message
    assert "No space left on device" in message, message
    assert "the checkpoint needs about 512.0 KiB = 524288 bytes (an estimate" in message, message
    assert "still names iteration 1, which stays loadable" in message, message
    assert sorted(os.listdir(root)) == ["iter_0000001", files.TRACKER]
    dist.save(root, 2, {"model.w": torch.ones(16, 16)}, COORDS, {}, single_process=True)
    assert files.read_tracker(root) == 2
