"""Errors a user sees, once and in one line (issue 38): an error every rank finds the same
way is printed once (the empty-split error was printed twice at 2 ranks) while a rank's own
error is still printed by that rank; a data loader worker that died is one line, not
torch's chained traceback."""
from __future__ import annotations

import contextlib
import io
import socket
from datetime import timedelta
from typing import Dict, List

import numpy as np

from multirank import run_on_ranks


class _Store:
    """The store calls training/run/errors.py makes (torch's TCPStore API)."""

    def __init__(self) -> None:
        self.data: Dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.data[key] = value.encode()

    def wait(self, keys: List[str], timeout: timedelta) -> None:
        if not all(k in self.data for k in keys):
            raise RuntimeError(f"Socket Timeout after {timeout}")

    def get(self, key: str) -> bytes:
        return self.data[key]


class _Watchdog:
    def __init__(self, store: _Store) -> None:
        self.store, self.prefix = store, "gigatron/watchdog/run/0/"


def test_rank0_prints_and_the_others_only_a_line_of_their_own():
    from gigatron.training.run.errors import should_print

    watchdog = _Watchdog(_Store())
    assert should_print("the same", 1, watchdog, wait_s=0.01)  # rank 0 said nothing
    assert should_print("the same", 0, watchdog)
    assert not should_print("the same", 1, watchdog)
    assert should_print("rank 1's own", 1, watchdog)
    assert should_print("anything", 3, None)  # one rank: no store


def _empty_split_run(rank: int, world: int, prefix: str) -> str:
    from gigatron.training.run import pretrain

    flags = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
             "--micro-batch-size 1 --train-iters 2 --lr 1e-3 --vocab-size 128 "
             "--tokenizer-type NullTokenizer --split 1,1,1 --eval-iters 1 --eval-interval 1 "
             f"--no-progress --data-path {prefix}").split()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert pretrain.main(flags) == 2
    return err.getvalue()


def test_an_error_every_rank_finds_is_printed_once(tmp_path):
    from gigatron.data.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "two_documents")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for _ in range(2):
        builder.add_item(np.arange(1, 200) % 100)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    printed = run_on_ranks(_empty_split_run, 2, prefix, timeout=120)
    lines = [line for text in printed for line in text.splitlines() if "error" in line]
    assert len(lines) == 1 and "the valid split is empty" in lines[0], printed


class _KillsItsWorker:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)  # as the out-of-memory killer would
        return index


def test_a_killed_data_loader_worker_is_one_line_not_a_traceback(monkeypatch, capsys):
    """One rank in this process (a forked rank is daemonic: it may not start workers)."""
    import torch

    from gigatron.training.run import loop, pretrain

    def train(session, progress):
        for _ in torch.utils.data.DataLoader(_KillsItsWorker(), num_workers=1):
            pass
        return progress

    monkeypatch.setattr(loop, "train", train)
    with socket.socket() as free:  # 29500 may be another test's
        free.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(free.getsockname()[1]))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    flags = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
             "--micro-batch-size 1 --train-iters 2 --lr 1e-3 --vocab-size 128 --mock-data "
             "--no-progress").split()
    assert pretrain.main(flags) == 1
    printed = capsys.readouterr().err
    lines = printed.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in printed, printed
    assert "a data loader worker process died (DataLoader worker (pid " in lines[0]
    assert "is killed by signal: Killed)" in lines[0] and "--num-workers 0" in lines[0]
