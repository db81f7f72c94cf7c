"""No training step between two log lines waits for the host (counted, not timed).

The whole training loop runs under `HostSyncCounter` (training/observe/host_syncs.py) with only the
log line, evaluation and checkpoint saving paused: fp32 and bf16 steps make zero host reads;
fp16 makes exactly one per step (its overflow flag decides the skip and the loss-scale
update, see ZeroOptimizer.step).
"""
import os
import sys

import pytest
import torch

from multirank import run_on_ranks

from gigatron.training.observe.host_syncs import HostSyncCounter

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --mock-data --vocab-size 128 "
         "--log-interval 4 --eval-iters 0 --no-progress --make-vocab-size-divisible-by 8 "
         "--train-iters 8 --clip-grad 1.0").split()


def test_counter_counts_reads_from_our_code_and_restores_tensor():
    t = torch.ones(())
    with HostSyncCounter() as counter:
        t.item()
        bool(t)
        f"{t:.1f}"
        with counter.paused():
            float(t)
        t + 1  # stays on the device
    assert counter.count == 3, counter.sites
    assert "item" not in torch.Tensor.__dict__ and t.item() == 1.0


def _count_train_syncs(rank, world, argv):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from gigatron.training.run import loop
    from gigatron.training.run import pretrain

    counter = HostSyncCounter()

    def pausing(fn):
        def run(*args, **kwargs):
            with counter.paused():
                return fn(*args, **kwargs)
        return run

    for name in ("_log", "_evaluate_and_log", "_save"):
        setattr(loop, name, pausing(getattr(loop, name)))
    real_train = loop.train

    def counted_train(session, progress):
        with counter:
            out = real_train(session, progress)
        steps.append(out.iteration)
        return out
    steps = []
    loop.train = counted_train
    assert pretrain.main(argv) == 0
    return counter.count, steps[0], dict(counter.sites)


@pytest.mark.parametrize("precision, per_step", [([], 0), (["--bf16"], 0), (["--fp16"], 1)])
def test_steps_between_log_lines_make_no_host_sync(precision, per_step):
    count, steps, sites = run_on_ranks(_count_train_syncs, 1, FLAGS + precision)[0]
    assert steps == 8
    assert count == per_step * steps, sites
