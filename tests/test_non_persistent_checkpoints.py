"""Non-persistent checkpoints (--non-persistent-save-interval 2, --save-interval 6): a run that
stops after iteration 9 resumes from the non-persistent checkpoint of iteration 8 (newer than
the persistent one of 6) and logs the uninterrupted run's losses, for each kind; only the
newest non-persistent checkpoint is kept; an older one loses to a newer persistent one.

"Stops after iteration 9": the uninterrupted run copies the checkpoint folders after its
iteration 9 (what a crash there would leave on disk and in /dev/shm), runs on to 10, and
the copies are put back for the restart, which re-runs the same command.
"""
import glob
import os
import shutil

import pytest

from multirank import run_on_ranks
from test_training_loop import FLAGS, _main, _program_on, _records

ARGV = FLAGS + ["--train-iters", "10", "--eval-iters", "0", "--num-workers", "0",
                "--save-interval", "6", "--non-persistent-save-interval", "2"]


@pytest.fixture(scope="module", autouse=True)
def imported_before_forking():
    """The forked ranks inherit the program's modules and torch's lazily imported compiler
    (AdamW's constructor imports torch._dynamo: ~3 s in every fresh process)."""
    import torch

    import gigatron.training.checkpoint.orchestrator  # noqa: F401
    import gigatron.training.run.loop  # noqa: F401
    import gigatron.training.run.pretrain  # noqa: F401
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])


def _main_copying_at_9(rank, world, argv, folders):
    """pretrain on this rank; rank 0 copies `folders` (src -> copy) before iteration 10."""
    from gigatron.training.run import loop

    real_step = loop.train_step

    def step(s, batches, progress):
        if progress.iteration == 9 and rank == 0:
            for src, copy in folders.items():
                shutil.copytree(src, copy)
        return real_step(s, batches, progress)
    loop.train_step = step
    return _main(rank, world, argv)


def _losses(path, first=1):
    return {r["iteration"]: r["lm loss"] for r in _records(path)
            if r["type"] == "train" and r["iteration"] >= first}


def _crash_at_9_and_restart(tmp_path, world, extra, before_restart=None):
    """(uninterrupted losses, restarted losses, the restart's stdout)."""
    ckpt, shm = str(tmp_path / "ckpt"), str(tmp_path / "shm")
    argv = ARGV + extra + ["--save", ckpt, "--load", ckpt,
                           "--non-persistent-local-ckpt-dir", shm]
    folders = {ckpt: str(tmp_path / "ckpt_at_9"), shm: str(tmp_path / "shm_at_9")}
    whole, again = str(tmp_path / "whole.jsonl"), str(tmp_path / "again.jsonl")
    os.makedirs(shm)
    results = run_on_ranks(_main_copying_at_9, world, argv + ["--metrics-file", whole],
                           folders, timeout=300)
    assert [r[0] for r in results] == [0] * world, results
    # the normal end saves a persistent checkpoint at 10: no non-persistent one is left
    assert not [f for _, _, names in os.walk(shm) for f in names]
    assert not glob.glob(os.path.join(ckpt, "non_persistent", "iter_*"))
    for src, copy in folders.items():
        shutil.rmtree(src)
        shutil.move(copy, src)
    if before_restart is not None:
        before_restart(argv, ckpt, shm)
    results = _program_on(world, argv + ["--metrics-file", again], timeout=300)
    assert [r[0] for r in results] == [0] * world, results
    return _losses(whole), _losses(again), results[0][2]


def _newer(argv, tracker_iteration, ckpt):
    """What --load would resume from with the persistent tracker at `tracker_iteration`
    (one rank, in this process)."""
    from gigatron.training.checkpoint import non_persistent, orchestrator
    from gigatron.training.config.arguments import parse_args

    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(f"{tracker_iteration}\n")
    run = parse_args(argv, 1)
    return non_persistent.newer_checkpoint(run, 0, orchestrator.copy_layout(run, 1))


@pytest.mark.parametrize("kind", ["global", "local"])
def test_restart_resumes_from_the_newer_non_persistent_checkpoint_exactly(tmp_path, kind,
                                                                          capsys):
    def before_restart(argv, ckpt, shm):
        if kind == "global":  # only the newest non-persistent checkpoint is kept
            assert sorted(os.listdir(os.path.join(ckpt, "non_persistent"))) == \
                ["iter_0000008", "latest_checkpointed_iteration.txt"]
        else:
            (job,) = os.listdir(shm)
            assert sorted(os.listdir(os.path.join(shm, job, "held_by_00000"))) == \
                ["rank_00000_iter_0000008.json", "rank_00000_iter_0000008.pt"]
        # an older non-persistent checkpoint loses to a newer persistent one
        assert _newer(argv, 10, ckpt) is None
        newer = _newer(argv, 6, ckpt)
        assert newer is not None
        if kind == "local":
            assert newer["progress"]["iteration"] == 8
            (job,) = os.listdir(shm)  # a damaged file: one line, then the persistent one
            path = os.path.join(shm, job, "held_by_00000", "rank_00000_iter_0000008.pt")
            data = open(path, "rb").read()
            open(path, "wb").write(data[:-1] + bytes([data[-1] ^ 1]))
            capsys.readouterr()
            assert _newer(argv, 6, ckpt) is None
            assert "does not match its recorded crc32; resuming from the persistent " \
                "checkpoint instead" in capsys.readouterr().out
            open(path, "wb").write(data)
    whole, again, out = _crash_at_9_and_restart(
        tmp_path, 1, ["--non-persistent-ckpt-type", kind], before_restart)
    assert "loaded checkpoint" in out and "(iteration 8," in out, out
    assert ("non_persistent/iter_0000008" if kind == "global" else "local non-persistent") \
        in out, out
    assert sorted(again) == [9, 10]
    assert again == {i: whole[i] for i in again}  # exact: fp32 on CPU


def test_in_memory_restart_after_losing_a_node_uses_the_peer_copy(tmp_path):
    """2 ranks with ZeRO 1 (each rank's optimizer shard differs): rank 1's memory is lost
    (its folder of copies deleted); rank 0 holds rank 1's copy and sends it back."""
    def lose_rank_1(argv, ckpt, shm):
        (job,) = os.listdir(shm)
        held = sorted(os.listdir(os.path.join(shm, job)))
        assert held == ["held_by_00000", "held_by_00001"], held
        assert sorted(os.listdir(os.path.join(shm, job, "held_by_00000"))) == [
            "rank_00000_iter_0000008.json", "rank_00000_iter_0000008.pt",
            "rank_00001_iter_0000008.json", "rank_00001_iter_0000008.pt"]
        shutil.rmtree(os.path.join(shm, job, "held_by_00001"))
    whole, again, out = _crash_at_9_and_restart(
        tmp_path, 2, ["--non-persistent-ckpt-type", "in_memory", "--zero-stage", "1"],
        lose_rank_1)
    assert "in_memory non-persistent) (iteration 8," in out, out
    assert sorted(again) == [9, 10]
    assert again == {i: whole[i] for i in again}


def _copy(owner, iteration, layout, path="p"):
    from gigatron.training.checkpoint.rank_copies import Copy
    return Copy(owner, iteration, f"{path}{owner}_{iteration}", {"layout": layout})


def test_choice_needs_every_rank_in_the_same_layout_and_says_why_not():
    from gigatron.training.checkpoint.rank_copies import choose

    two = {"tp": 1, "pp": 1, "dp": 2}
    # rank 1 lost its own file of 8 but rank 0 holds a copy; iteration 6 is not newer
    seen = [[_copy(0, 8, two), _copy(1, 8, two), _copy(0, 6, two)], [_copy(1, 6, two)]]
    plan, note = choose(seen, 2, two, 6, "in_memory")
    assert note is None and plan.iteration == 8
    assert {owner: reader for owner, (reader, _) in plan.readers.items()} == {0: 0, 1: 0}
    # the owner reads its own file when it has one
    plan, _ = choose([[_copy(0, 8, two), _copy(1, 8, two)], [_copy(1, 8, two)]], 2, two, 6,
                     "in_memory")
    assert plan.readers[1][0] == 1
    assert choose(seen, 2, two, 8, "in_memory") == (None, None)  # persistent is as new
    plan, note = choose([[_copy(0, 8, two)], []], 2, two, -1, "local")
    assert plan is None
    assert note == ("the local non-persistent checkpoint of iteration 8 is incomplete: no "
                    "copy of the state of rank 1 is left; resuming from the persistent "
                    "checkpoint instead")
    four = {"tp": 2, "pp": 1, "dp": 2}
    plan, note = choose(seen, 2, four, -1, "local")
    assert plan is None and "saved with tp=1 pp=1 dp=2 but this run has tp=2 pp=1 dp=2" in note
    assert "resuming from the persistent checkpoint instead" in note
    # the newest incomplete, an older complete one newer than the persistent: the older
    plan, _ = choose([[_copy(0, 8, two), _copy(0, 6, two), _copy(1, 6, two)]], 2, two, 4,
                     "local")
    assert plan.iteration == 6


def test_copies_go_to_the_next_node_or_the_next_rank():
    from gigatron.training.checkpoint.rank_copies import peer_ranks

    assert peer_ranks(["a"] * 4) == [1, 2, 3, 0]
    assert peer_ranks(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert peer_ranks(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]
    assert peer_ranks(["a"]) == [0]


def test_a_half_written_copy_does_not_count(tmp_path):
    from gigatron.training.checkpoint.rank_copies import copy_path, inventory, remove_copies

    job = str(tmp_path / "job")
    done, torn = copy_path(job, 0, 0, 8), copy_path(job, 0, 0, 10)
    os.makedirs(os.path.dirname(done))
    for path in (done, torn + ".part", done[:-3] + ".json", torn[:-3] + ".json"):
        open(path, "w").write("{}")
    assert [(c.owner, c.iteration) for c in inventory(job)] == [(0, 8)]
    remove_copies(job, 0, keep=8)
    assert sorted(os.listdir(os.path.dirname(done))) == ["rank_00000_iter_0000008.json",
                                                        "rank_00000_iter_0000008.pt"]


@pytest.mark.parametrize("extra,message", [
    ("--non-persistent-ckpt-type local --non-persistent-save-interval 2 --save S",
     "--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir DIR"),
    ("--non-persistent-save-interval 2 --save S",
     "--non-persistent-save-interval needs --non-persistent-ckpt-type global, local or "
     "in_memory"),
    ("--non-persistent-save-interval 2 --non-persistent-ckpt-type global",
     "--non-persistent-save-interval needs --save DIR"),
    ("--non-persistent-save-interval 0 --non-persistent-ckpt-type global --save S",
     "--non-persistent-save-interval must be > 0, got 0"),
    ("--non-persistent-ckpt-type global --save S --non-persistent-global-ckpt-dir S",
     "--non-persistent-global-ckpt-dir S is the --save folder"),
])
def test_bad_combinations_name_the_flag_in_one_line(tmp_path, extra, message):
    from gigatron.training.config.arguments import parse_args

    argv = FLAGS + ["--train-iters", "4"] + extra.replace("S", str(tmp_path / "c")).split()
    with pytest.raises(ValueError) as err:
        parse_args(argv, 1)
    assert str(err.value).startswith(message.replace("S", str(tmp_path / "c"))), err.value
    assert len(str(err.value).splitlines()) == 1
