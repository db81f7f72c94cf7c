"""What the run asks of the machine: device notes and the before-start-up memory check."""
import contextlib
import io

import pytest
import torch

from gigatron.training.run.preflight import (GIB, MemoryEstimate, check_memory, device_notes,
                                         estimate_memory, local_ranks)

SMALL = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --global-batch-size 8 --lr 1e-2 --mock-data --vocab-size 128 "
         "--train-iters 1 --make-vocab-size-divisible-by 8").split()


def _run(argv, world=1):
    from gigatron.training.config.arguments import build_run_config, parse_flags

    return build_run_config(parse_flags(argv), world, None)


def test_weights_gradients_and_optimizer_follow_dtype_and_zero_stage():
    from gigatron.models.gpt import GPTModel

    run = _run(SMALL)
    params = sum(p.numel() for p in GPTModel(run.model).parameters())
    cpu = torch.device("cpu")
    fp32 = estimate_memory(run, params, cpu)
    assert fp32.weights == params * 4 and fp32.gradients == params * 4
    assert fp32.optimizer == params * 8  # Adam's two moments; the fp32 master is the weights
    bf16 = estimate_memory(_run(SMALL + ["--bf16"]), params, cpu)
    assert bf16.weights == params * 2 and bf16.optimizer == params * 12  # + fp32 master
    zero3 = estimate_memory(_run(SMALL + ["--zero-stage", "3"], world=4), params, cpu)
    assert zero3.weights == params * 4 / 4 and zero3.optimizer == params * 8 / 4
    zero1 = estimate_memory(_run(SMALL + ["--zero-stage", "1"], world=4), params, cpu)
    assert zero1.weights == params * 4 and zero1.optimizer == params * 8 / 4


def test_activations_follow_megatrons_formula_and_recompute():
    run = _run(SMALL)
    s, b, h, a, layers = 16, 2, 32, 4, 2
    expected = s * b * h * (34 + 5 * a * s / h) * 4 / 2 * layers  # fp32: twice the 2-byte case
    assert estimate_memory(run, 1000, torch.device("cpu")).activations == expected
    full = _run(SMALL + ["--recompute-granularity", "full", "--recompute-method", "uniform",
                         "--recompute-num-layers", "1"])
    assert estimate_memory(full, 1000, torch.device("cpu")).activations == s * b * h * 4 * layers


def test_a_run_that_cannot_fit_is_refused_naming_the_numbers_and_the_flags():
    need = MemoryEstimate(weights=10 * GIB, gradients=10 * GIB, optimizer=20 * GIB,
                          activations=5 * GIB)
    with pytest.raises(ValueError) as err:
        check_memory(need, 24 * GIB / 2, torch.device("cpu"), 2)
    msg = str(err.value)
    assert "at least 45.0 GiB (weights 10.0, gradients 10.0, optimizer 20.0" in msg
    assert "each of its 2 local ranks 12.0 GiB" in msg
    assert "--micro-batch-size" in msg and "--zero-stage" in msg
    check_memory(need, 46 * GIB, torch.device("cpu"), 1)  # fits: no error


def test_local_ranks_come_from_the_launcher():
    assert local_ranks({"LOCAL_WORLD_SIZE": "4"}, 16) == 4
    assert local_ranks({"SLURM_NTASKS_PER_NODE": "8(x2)"}, 16) == 8
    assert local_ranks({}, 3) == 3


def test_device_notes_say_what_the_cpu_cannot_honour():
    run = _run(SMALL + ["--bf16"])
    lines = device_notes(torch.device("cpu"), "gloo", run, {"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert lines[0].startswith("device: cpu (") and lines[0].endswith("backend gloo")
    assert any("set up for GPUs (CUDA_DEVICE_MAX_CONNECTIONS set)" in x for x in lines)
    assert any("--bf16 on a CPU" in x for x in lines)
    assert device_notes(torch.device("cpu"), "gloo", _run(SMALL), {}) == lines[:1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_pretrain_refuses_a_model_larger_than_the_machine_before_start_up():
    from gigatron.training.run import pretrain

    argv = ("--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
            "--micro-batch-size 1 --global-batch-size 1 --lr 1e-4 --mock-data "
            "--vocab-size 50257 --train-iters 1").split()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain.main(argv)
    assert code == 2
    assert "the run needs at least" in err.getvalue() and "GiB" in err.getvalue()
    assert len(err.getvalue().strip().splitlines()) == 1, err.getvalue()


def test_the_banner_names_device_and_backend():
    from test_training_loop import FLAGS, _program_on

    code, err, out = _program_on(1, FLAGS + ["--train-iters", "1", "--eval-iters", "0"])[0]
    assert code == 0, err
    assert "device: cpu (" in out and "backend gloo" in out
    assert "\nparallel: schedule none (pp=1: no pipelining), " in out  # tests/test_banner.py
