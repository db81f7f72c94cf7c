"""Checkpoint files: a crash (kill -9) at any point of a save leaves the previous one loadable."""
import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from gigatron.training.checkpoint import folders as files
from gigatron.training.checkpoint.safetensors_io import load_state, save_state

COORDS = {"tp": 0, "pp": 0, "dp": 0}
META = {"tp": 1, "pp": 1, "dp": 1, "virtual_chunks": 1}

# A child process saves iteration 1 cleanly, then dies by SIGKILL at the point named by
# argv[2] while saving iteration 2.
CHILD = textwrap.dedent("""
    import os, signal, sys, torch
    from gigatron.training.checkpoint import folders as files

    root, where = sys.argv[1], sys.argv[2]
    coords = {"tp": 0, "pp": 0, "dp": 0}
    meta = {"tp": 1, "pp": 1, "dp": 1, "virtual_chunks": 1}
    state = lambda it: {"iteration": it, "w": torch.full((256, 256), float(it))}
    files.save_checkpoint(root, 1, state(1), coords, meta)

    def die(*_a, **_k):
        os.kill(os.getpid(), signal.SIGKILL)

    real_save, real_replace = torch.save, os.replace
    if where == "mid-shard":  # half the bytes of the shard are on disk
        def torch_save(obj, f):
            f.write(b"\\x80" * 1000)
            f.flush()
            die()
        torch.save = torch_save
    elif where == "before-publish":  # every shard written, folder not yet renamed
        files.publish = die
    elif where == "before-tracker":  # folder renamed, tracker not yet replaced
        files.atomic_write_text = die
    elif where == "mid-tracker":  # tracker's temp file written, not yet renamed
        def replace(src, dst):
            if dst.endswith(files.TRACKER):
                die()
            real_replace(src, dst)
        os.replace = replace
    files.save_checkpoint(root, 2, state(2), coords, meta)
    print("not killed")
""")


@pytest.mark.parametrize("where", ["mid-shard", "before-publish", "before-tracker",
                                   "mid-tracker"])
def test_kill_9_during_save_leaves_previous_checkpoint_loadable(tmp_path, where):
    root = str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", CHILD, root, where], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    iteration, folder = files.find_checkpoint(root)
    assert iteration == 1
    shard = files.read_shard(files.rank_file(folder, COORDS))
    assert shard["iteration"] == 1 and torch.equal(shard["w"], torch.full((256, 256), 1.0))
    files.check_layout(files.read_metadata(folder), META, folder)
    # the next save after the crash succeeds and becomes the tracked checkpoint
    files.save_checkpoint(root, 2, {"iteration": 2}, COORDS, META)
    assert files.find_checkpoint(root)[0] == 2
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", files.TRACKER] or \
        where == "mid-tracker"  # a dead writer's tracker temp file may remain; harmless


def test_resaving_an_iteration_replaces_it(tmp_path):
    root = str(tmp_path)
    for value in (1.0, 2.0):
        files.save_checkpoint(root, 5, {"x": value}, COORDS, META)
    _, folder = files.find_checkpoint(root)
    assert files.read_shard(files.rank_file(folder, COORDS))["x"] == 2.0
    assert sorted(os.listdir(root)) == ["iter_0000005", files.TRACKER]


def test_crash_while_resaving_an_iteration_keeps_its_old_copy(tmp_path):
    root = str(tmp_path)
    files.save_checkpoint(root, 5, {"x": 1.0}, COORDS, META)
    final = files.iteration_dir(root, 5)
    # the state a kill leaves between "move the old copy aside" and "publish the new one"
    os.replace(final, f"{final}.old.4242")
    iteration, folder = files.find_checkpoint(root)
    assert (iteration, folder) == (5, final)
    assert files.read_shard(files.rank_file(folder, COORDS))["x"] == 1.0


def test_no_tracker_means_no_checkpoint(tmp_path):
    assert files.find_checkpoint(str(tmp_path)) == (None, None)


def test_bad_tracker_and_missing_folder_are_clear_errors(tmp_path):
    (tmp_path / files.TRACKER).write_text("abc")
    with pytest.raises(ValueError, match="not an iteration number"):
        files.find_checkpoint(str(tmp_path))
    (tmp_path / files.TRACKER).write_text("7\n")
    with pytest.raises(ValueError, match="names iteration 7 but .*iter_0000007 does not exist"):
        files.find_checkpoint(str(tmp_path))


def test_loading_under_another_layout_is_a_clear_error(tmp_path):
    files.save_checkpoint(str(tmp_path), 3, {}, COORDS, META)
    folder = files.iteration_dir(str(tmp_path), 3)
    with pytest.raises(ValueError, match=r"saved with tp=1 pp=1 dp=1 virtual_chunks=1 but this "
                                         r"run has tp=2 pp=1 dp=1 virtual_chunks=1: a per-rank "
                                         r"\(--ckpt-format torch or safetensors\) checkpoint "
                                         r"loads only into the layout that saved it"):
        files.check_layout(files.read_metadata(folder), {**META, "tp": 2}, folder)


def _rank_saves(rank, world, root):
    from gigatron.training.checkpoint.integrity import job_gather
    coords = {"tp": rank % 2, "pp": 0, "dp": rank // 2}
    files.save_checkpoint(root, 4, {"rank": rank}, coords, {"tp": 2, "pp": 1, "dp": 2},
                          job_gather(torch.device("cpu")), rank == 0)
    return files.read_shard(files.rank_file(files.iteration_dir(root, 4), coords))["rank"]


def test_every_rank_writes_its_own_shard(tmp_path):
    from multirank import run_on_ranks
    assert run_on_ranks(_rank_saves, 4, str(tmp_path)) == [0, 1, 2, 3]
    folder = files.iteration_dir(str(tmp_path), 4)
    assert sorted(os.listdir(folder)) == ["metadata.json", "mp_rank_00_000_000",
                                          "mp_rank_00_000_001", "mp_rank_01_000_000",
                                          "mp_rank_01_000_001"]


def test_safetensors_round_trip_of_nested_state(tmp_path):
    random.seed(3)
    state = {"model": [{"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16)}],
             "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                     "torch": torch.get_rng_state()},
             "progress": {"iteration": 6, "lr_steps": 48}, "name": None, "flags": [1, "a"]}
    path = str(tmp_path / "s.safetensors")
    save_state(state, path)
    back = load_state(path)
    assert torch.equal(back["model"][0]["w"], state["model"][0]["w"])
    assert back["model"][0]["b"].dtype == torch.bfloat16
    assert back["rng"]["python"] == state["rng"]["python"]
    assert back["rng"]["numpy"][0] == "MT19937"
    assert np.array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert torch.equal(back["rng"]["torch"], state["rng"]["torch"])
    assert back["progress"] == state["progress"] and back["flags"] == [1, "a"]


def test_safetensors_refuses_objects_it_cannot_store(tmp_path):
    with pytest.raises(ValueError, match="use --ckpt-format torch"):
        save_state({"x": object()}, str(tmp_path / "s.safetensors"))
