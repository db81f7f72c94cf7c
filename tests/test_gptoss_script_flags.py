"""The flags examples/gptoss/02_train.sh passes that gigatron used to refuse: three accepted
without effect (a fused kernel, a logging series, a ModelOpt export choice: the same numbers),
--disable-bf16-reduced-precision-matmul doing what Megatron-Core does with it."""
import torch

from gigatron.training.config.arguments import parse_args
from gigatron.training.run.pretrain import matmul_precision

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --train-iters 4 --lr 1e-3 --mock-data --vocab-size 64 "
         "--num-experts 2 --bf16").split()


def test_the_scripts_flags_are_accepted():
    run = parse_args(FLAGS + ["--moe-permute-fusion", "--moe-per-layer-logging",
                              "--export-force-local-attention",
                              "--disable-bf16-reduced-precision-matmul"], 1)
    assert run.settings.precision.disable_bf16_reduced_precision_matmul


def test_disable_bf16_reduced_precision_matmul_turns_torch_s_switch_off_under_bf16():
    before = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        matmul_precision(parse_args(FLAGS, 1).settings.precision)
        assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        matmul_precision(parse_args(
            FLAGS + ["--disable-bf16-reduced-precision-matmul"], 1).settings.precision)
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = before


def test_logging_level_sets_the_root_logger_as_megatron_does(monkeypatch):
    import logging

    from gigatron.training.run.pretrain import logging_level

    run = parse_args(FLAGS + ["--logging-level", "40", "--enable-experimental",
                              "--auto-detect-ckpt-format"], 1)
    root = logging.getLogger()
    before = root.level
    try:
        logging_level(run.logging.logging_level)
        assert root.level == 40
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "30")
        logging_level(None)
        assert root.level == 30
    finally:
        root.setLevel(before)
