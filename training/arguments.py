"""Megatron's command-line flags, the ONE place where flags become config objects.

`parse_flags(argv)` reads the flags (an unknown flag is an error naming it, with the nearest
known flag); `build_run_config(flags, world_size, vocab_size)` validates them together and
returns a `RunConfig`. Every inconsistency raises a `ValueError` whose one-line message
names the flags and the fix, before any process group, model or data is touched.
"""
from __future__ import annotations

import argparse
import difflib
import math
from typing import Optional, Sequence

from gigatron.data.builder import GPTDataConfig
from gigatron.parallel.zero.config import ZeroConfig
from gigatron.training.config import (CheckpointConfig, LoggingConfig, ParallelConfig,
                                      RunConfig, TrainConfig)
from gigatron.training.deepspeed_config import (CONFIG_ONLY_DESTS, apply_deepspeed_config,
                                                load_deepspeed_config)
from gigatron.training.lr_schedule import DECAY_STYLES, WSD_DECAY_STYLES
from gigatron.training.validation import (build_lr_schedule, build_model_config,
                                          check_checkpointing, check_data, check_logging,
                                          check_optimizer, check_parallel, check_train,
                                          data_parallel_size, microbatches)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError (one line) instead of printing usage and exiting."""

    def error(self, message: str):
        raise ValueError(message)


def _opt_true(parser, name: str, help: str) -> None:
    """A switch that is None when absent, so a --model zoo value can show through."""
    parser.add_argument(name, action="store_true", default=None, help=help)


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (flags override the --model zoo config)")
    g.add_argument("--model", help="zoo model name (e.g. gpt2-124m, llama3-8b)")
    for name in ("--num-layers", "--hidden-size", "--ffn-hidden-size", "--num-attention-heads",
                 "--num-query-groups", "--seq-length", "--max-position-embeddings",
                 "--make-vocab-size-divisible-by"):
        g.add_argument(name, type=int)
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"))
    g.add_argument("--rotary-base", type=float)
    g.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    g.add_argument("--norm-epsilon", type=float)
    _opt_true(g, "--group-query-attention", "use --num-query-groups key/value groups")
    _opt_true(g, "--swiglu", "SwiGLU MLP (Llama style)")
    _opt_true(g, "--untie-embeddings-and-output-weights", "separate output layer")
    _opt_true(g, "--disable-bias-linear", "no biases in linear layers")
    g.add_argument("--hidden-dropout", type=float)
    g.add_argument("--attention-dropout", type=float)
    g.add_argument("--init-method-std", type=float)
    g.add_argument("--attention-backend", choices=("sdpa", "unfused"))
    g.add_argument("--recompute-granularity", choices=("full", "selective"))
    g.add_argument("--recompute-method", choices=("uniform", "block"))
    g.add_argument("--recompute-num-layers", type=int)


def _add_parallel_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=int)
    g.add_argument("--decoder-last-pipeline-num-layers", type=int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Megatron's name for ZeRO stage 1")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3))
    g.add_argument("--ddp-bucket-size", type=int, help="gradient bucket size (elements)")
    g.add_argument("--grad-reduce-in-bf16", action="store_true")
    g.add_argument("--optimizer-cpu-offload", action="store_true")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--deepspeed-config", "--deepspeed_config", dest="deepspeed_config",
                   metavar="PATH", help="a DeepSpeed JSON config (batch sizes, zero_optimization,"
                   " fp16/bf16, optimizer, gradient_clipping, steps_per_print): fills flags not "
                   "given; a flag that disagrees with it, or an unsupported key, is an error")
    p.set_defaults(**CONFIG_ONLY_DESTS)  # namespace entries only a DeepSpeed config sets


def _add_optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=DECAY_STYLES, default="linear")
    g.add_argument("--lr-decay-iters", type=int)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-wsd-decay-style", choices=WSD_DECAY_STYLES, default="exponential")
    g.add_argument("--lr-wsd-decay-iters", type=int)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, help="static loss scale (fp16)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", help="prefix, or weight prefix weight prefix ...")
    g.add_argument("--split", default="969,30,1")
    g.add_argument("--train-data-path", nargs="*")
    g.add_argument("--valid-data-path", nargs="*")
    g.add_argument("--test-data-path", nargs="*")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-cache-path")
    g.add_argument("--tokenizer-type", choices=("SentencePieceTokenizer", "GPT2BPETokenizer",
                                                 "HuggingFaceTokenizer", "NullTokenizer"))
    g.add_argument("--tokenizer-model")
    g.add_argument("--vocab-file")
    g.add_argument("--merge-file")
    g.add_argument("--vocab-size", type=int)
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document")
    g.add_argument("--num-workers", type=int, default=0, help="data loader worker processes")


def _add_training_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training, evaluation, checkpoints, logging")
    g.add_argument("--micro-batch-size", type=int)
    g.add_argument("--global-batch-size", type=int)
    g.add_argument("--train-iters", type=int)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train-test", dest="skip_test", action="store_true",
                   help="skip the test-split evaluation at the end")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--timing-log-level", type=int, choices=(0, 1, 2), default=0,
                   help=">= 1: synchronise the accelerator around timed phases")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--save")
    g.add_argument("--load")
    g.add_argument("--save-interval", type=int)
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--ckpt-format", choices=("torch", "safetensors"), default="torch")
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--exit-signal-handler", action="store_true")
    g.add_argument("--tensorboard-dir")
    g.add_argument("--metrics-file", help="JSON lines, one per logged iteration / eval")
    g.add_argument("--peak-tflops", type=float, help="device peak for MFU (else the table)")
    g.add_argument("--progress", dest="progress", action="store_true", default=None)
    g.add_argument("--no-progress", dest="progress", action="store_false")


def make_parser() -> argparse.ArgumentParser:
    """The parser of pretrain_gpt.py: Megatron's flag names and meanings."""
    p = _Parser(prog="pretrain_gpt.py", allow_abbrev=False,
                description="Pretrain a GPT model with tensor, pipeline and ZeRO parallelism.")
    for add in (_add_model_flags, _add_parallel_flags, _add_optimizer_flags, _add_data_flags,
                _add_training_flags):
        add(p)
    return p


def parse_flags(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse argv; unknown flags raise a ValueError naming them (and a close known flag)."""
    parser = make_parser()
    flags, unknown = parser.parse_known_args(argv)
    if unknown:
        known = [s for a in parser._actions for s in a.option_strings]
        first = next((u for u in unknown if u.startswith("-")), unknown[0])
        close = difflib.get_close_matches(first.split("=")[0], known, n=1)
        hint = f"; did you mean {close[0]}?" if close else "; see pretrain_gpt.py --help"
        raise ValueError(f"unknown flag(s) {' '.join(unknown)}{hint}")
    if flags.deepspeed_config is not None:
        ds = load_deepspeed_config(flags.deepspeed_config)
        try:
            flags = apply_deepspeed_config(ds, flags, _explicit_dests(argv))
        except ValueError as err:
            raise ValueError(f"--deepspeed-config {flags.deepspeed_config}: {err}") from None
    return flags


def _explicit_dests(argv: Optional[Sequence[str]]) -> set:
    """The dests of the flags given on the command line (not left at their defaults)."""
    parser = make_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv)
    return set(vars(given)) - set(CONFIG_ONLY_DESTS)


def build_run_config(flags: argparse.Namespace, world_size: int,
                     vocab_size: Optional[int] = None) -> RunConfig:
    """Validate the flags together and map them to the run's config objects."""
    tp, pp = flags.tensor_model_parallel_size, flags.pipeline_model_parallel_size
    dp = data_parallel_size(world_size, tp, pp)
    check_parallel(flags, tp, pp)
    model = build_model_config(flags, tp, vocab_size)
    mbs, gbs, num_mb = microbatches(flags, dp)
    parallel = ParallelConfig(
        tp=tp, pp=pp, dp=dp, sequence_parallel=bool(flags.sequence_parallel and tp > 1),
        num_layers_per_virtual_pipeline_stage=flags.num_layers_per_virtual_pipeline_stage,
        decoder_first_pipeline_num_layers=flags.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=flags.decoder_last_pipeline_num_layers,
        distributed_timeout_minutes=flags.distributed_timeout_minutes)
    check_train(flags, parallel, model, num_mb)
    check_optimizer(flags, parallel)
    check_data(flags)
    data = GPTDataConfig(
        seq_length=model.seq_length, seed=flags.seed, data_path=flags.data_path,
        split=flags.split, train_data_path=flags.train_data_path,
        valid_data_path=flags.valid_data_path, test_data_path=flags.test_data_path,
        mock_data=flags.mock_data, data_cache_path=flags.data_cache_path,
        eod_mask_loss=flags.eod_mask_loss, vocab_size=flags.vocab_size)
    train = TrainConfig(
        train_iters=flags.train_iters, micro_batch_size=mbs, global_batch_size=gbs,
        num_microbatches=num_mb, seed=flags.seed, eval_interval=flags.eval_interval,
        eval_iters=flags.eval_iters, skip_test=flags.skip_test,
        exit_interval=flags.exit_interval, exit_signal_handler=flags.exit_signal_handler,
        num_workers=flags.num_workers)
    check_checkpointing(flags)
    checkpoint = CheckpointConfig(
        save=flags.save, load=flags.load, save_interval=flags.save_interval,
        no_load_optim=flags.no_load_optim, no_load_rng=flags.no_load_rng,
        finetune=flags.finetune, no_save_optim=flags.no_save_optim,
        no_save_rng=flags.no_save_rng, ckpt_format=flags.ckpt_format)
    check_logging(flags)
    logging = LoggingConfig(log_interval=flags.log_interval, metrics_file=flags.metrics_file,
                            tensorboard_dir=flags.tensorboard_dir,
                            peak_tflops=flags.peak_tflops, progress=flags.progress,
                            timing_log_level=flags.timing_log_level)
    return RunConfig(model=model, model_name=flags.model, parallel=parallel,
                     zero=zero_config(flags), lr_schedule=build_lr_schedule(flags, gbs),
                     data=data, train=train, checkpoint=checkpoint, logging=logging,
                     flags=dict(vars(flags)))


def zero_config(flags: argparse.Namespace) -> ZeroConfig:
    """The optimizer, mixed-precision, clipping and ZeRO flags as the ZeRO wrapper's config."""
    stage = flags.zero_stage if flags.zero_stage is not None else \
        (1 if flags.use_distributed_optimizer else 0)
    kw = dict(zero_stage=stage,
              # Megatron's --optimizer adam is AdamW (decoupled weight decay)
              optimizer="adamw" if flags.optimizer == "adam" else "sgd",
              lr=flags.lr, weight_decay=flags.weight_decay, adam_beta1=flags.adam_beta1,
              adam_beta2=flags.adam_beta2, adam_eps=flags.adam_eps,
              sgd_momentum=flags.sgd_momentum, clip_grad=flags.clip_grad,
              loss_scale=flags.loss_scale or 0.0,
              initial_scale_power=int(round(math.log2(flags.initial_loss_scale))),
              loss_scale_window=flags.loss_scale_window, hysteresis=flags.hysteresis,
              min_loss_scale=flags.min_loss_scale, grad_reduce_in_bf16=flags.grad_reduce_in_bf16,
              offload_optimizer="cpu" if flags.optimizer_cpu_offload else "none")
    if flags.ddp_bucket_size is not None:
        kw["reduce_bucket_size"] = flags.ddp_bucket_size
    for dest in ("overlap_comm", "consecutive_hysteresis"):  # set by --deepspeed-config only
        if getattr(flags, dest, None) is not None:
            kw[dest] = getattr(flags, dest)
    return ZeroConfig(**kw)


def parse_args(argv: Optional[Sequence[str]], world_size: int,
               vocab_size: Optional[int] = None) -> RunConfig:
    """parse_flags + build_run_config: argv to a validated RunConfig."""
    return build_run_config(parse_flags(argv), world_size, vocab_size)

