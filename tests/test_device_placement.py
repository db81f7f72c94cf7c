"""Device placement on the paths that only matter on GPUs (NCCL takes no CPU tensors), checked
on CPU with a stand-in device and recording fakes: these code paths never run on gloo."""
from types import SimpleNamespace

import pytest
import torch

from gigatron.parallel import comm
from gigatron.training.run import loop

FAKE_DEVICE = torch.device("meta")  # any non-CPU device: what matters is that it is passed on


class _Reduced(Exception):
    """Raised by the fake collective: a meta tensor cannot be read back."""


def test_training_loop_reductions_run_on_the_session_device(monkeypatch):
    devices = []

    def all_reduce(tensor, group=None, op=comm.ReduceOp.SUM, async_op=False):
        devices.append(tensor.device)
        raise _Reduced

    monkeypatch.setattr(comm, "all_reduce", all_reduce)
    s = SimpleNamespace(device=FAKE_DEVICE, pipeline=SimpleNamespace(needs_labels=True))
    with pytest.raises(_Reduced):  # the interval's losses
        loop.mean_loss_over_ranks(s, torch.ones((), device=FAKE_DEVICE), 2)
    with pytest.raises(_Reduced):  # peak memory and the exit flag
        loop.max_over_ranks(s, [1.0, 0.0])
    assert devices == [FAKE_DEVICE, FAKE_DEVICE]


def _init_distributed_kwargs(monkeypatch, device, backend):
    import torch.distributed as dist
    from gigatron.parallel import world as launch

    calls = []
    monkeypatch.setattr(launch, "device_and_backend", lambda local_rank: (device, backend))
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: calls.append((a, kw)))
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert launch.init_distributed(env=env)[1] == device
    return calls[0][1]


def test_init_distributed_binds_the_gpu_so_nccl_communicators_start_eagerly(monkeypatch):
    gpu = torch.device("cuda", 1)
    assert _init_distributed_kwargs(monkeypatch, gpu, "nccl")["device_id"] == gpu
    assert "device_id" not in _init_distributed_kwargs(monkeypatch, torch.device("cpu"), "gloo")


def test_tracker_rng_saved_on_one_gpu_index_resumes_on_another():
    from gigatron.parallel.tensor.random import MODEL_PARALLEL_RNG, TensorParallelRNGTracker
    from gigatron.training.checkpoint.orchestrator import restore_rng, rng_state

    tracker = TensorParallelRNGTracker()
    tracker.add(MODEL_PARALLEL_RNG, 7)
    with tracker.fork(torch.device("cpu")):
        torch.rand(3)  # advance the stream so a reseeded one would differ
    saved = rng_state([SimpleNamespace(rng_tracker=tracker)], torch.device("cpu"))
    state = tracker.get_states()[(MODEL_PARALLEL_RNG, "cpu")]
    saved["tracker"] = [[[MODEL_PARALLEL_RNG, "cuda:5", state]]]  # as saved by a rank on GPU 5
    resumed = TensorParallelRNGTracker()
    resumed.add(MODEL_PARALLEL_RNG, 7)
    restore_rng(saved, [SimpleNamespace(rng_tracker=resumed)], torch.device("cuda", 1))
    assert list(resumed.get_states()) == [(MODEL_PARALLEL_RNG, "cuda:1")]
    assert torch.equal(resumed.get_states()[(MODEL_PARALLEL_RNG, "cuda:1")], state)
