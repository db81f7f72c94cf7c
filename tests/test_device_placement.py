"""Device placement on the paths that only matter on GPUs (NCCL takes no CPU tensors), checked
on CPU with a stand-in device and recording fakes: these code paths never run on gloo."""
import signal
from types import SimpleNamespace

import torch

from gigatron.parallel import comm
from gigatron.training import loop

FAKE_DEVICE = torch.device("meta")  # any non-CPU device: what matters is that it is passed on


def test_training_loop_scalar_reductions_run_on_the_session_device(monkeypatch):
    devices = []

    def all_reduce_scalar(value, group=None, op=comm.ReduceOp.SUM, device=None):
        devices.append(device)
        return value

    monkeypatch.setattr(comm, "all_reduce_scalar", all_reduce_scalar)
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(loop, "peak_memory_bytes", lambda device: 0)
    records = []
    s = SimpleNamespace(
        device=FAKE_DEVICE, pipeline=SimpleNamespace(needs_labels=True),
        groups=SimpleNamespace(dp=None, pp=None),
        run=SimpleNamespace(parallel=SimpleNamespace(dp=2, world_size=2),
                            train=SimpleNamespace(global_batch_size=4),
                            model=SimpleNamespace(seq_length=8)),
        timers=SimpleNamespace(reset=lambda: {}), flops_per_token=1.0, peak_tflops=None,
        logger=SimpleNamespace(train=records.append))
    assert loop._global_mean(3.0, s) == 1.5  # the fake reduction is the identity: 3 / dp
    assert loop.ExitSignal(True, s.device).any_rank() is False
    outcome = loop.StepOutcome(1.0, 0.1, None, 1.0, False)
    interval = loop._Interval()
    interval.add(outcome)
    loop._log(s, loop.TrainProgress(iteration=1), outcome, interval)
    assert len(records) == 1
    assert len(devices) == 4 and all(d == FAKE_DEVICE for d in devices), devices
