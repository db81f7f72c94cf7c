"""Megatron's command-line flags, the ONE place where flags become config objects.

`make_parser()` is generated from the config table (`training/config/table.py`); `parse_flags(argv)`
reads the flags (every unknown flag and bad value at once, with the nearest known flag) and
fills the ones not given from `--deepspeed-config`; `build_run_config(flags, world_size,
vocab_size)` validates them together (`validation.py`) and returns a `RunConfig`. Every
problem is reported at once, as one ValueError with a line per problem naming the flag and
the fix, before any process group, model or data is touched.
"""
from __future__ import annotations

import argparse
import math
from typing import List, Optional, Sequence

from gigatron.data.builder import GPTDataConfig
from gigatron.parallel.zero.config import ZeroConfig, zero_problems
from gigatron.training.config.run_config import (CheckpointConfig, LoggingConfig, ParallelConfig,
                                      RunConfig, TrainConfig)
from gigatron.training.config.table import (ParseProblems, build_parser, flag_name, table,
                                            values)
from gigatron.training.config.deepspeed.pretrain import apply_deepspeed_config, load_deepspeed_config
from gigatron.training.config.megatron.model import build_model_config
from gigatron.training.config.features import check_operational
from gigatron.training.config.megatron.schedule import build_lr_schedule, training_length
from gigatron.training.config.validation import (ConfigError, Problems, check_checkpointing,
                                          check_data, check_logging, check_optimizer,
                                          check_parallel, check_train, data_parallel_size,
                                          microbatches)

# ZeroConfig field -> the flag dest it is computed from (names its problems)
ZERO_FLAGS = {"zero_stage": "zero_stage", "optimizer": "optimizer", "lr": "lr",
              "weight_decay": "weight_decay", "adam_beta1": "adam_beta1",
              "adam_beta2": "adam_beta2", "adam_eps": "adam_eps",
              "sgd_momentum": "sgd_momentum", "clip_grad": "clip_grad",
              "loss_scale": "loss_scale", "initial_scale_power": "initial_loss_scale",
              "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
              "min_loss_scale": "min_loss_scale", "grad_reduce_dtype": "grad_reduce_in_bf16",
              "grad_reduce_in_bf16": "grad_reduce_in_bf16",
              "offload_optimizer": "optimizer_cpu_offload",
              "reduce_bucket_size": "ddp_bucket_size", "overlap_comm": "overlap_comm",
              "consecutive_hysteresis": "consecutive_hysteresis"}


def make_parser(prog: str = "pretrain_gpt.py") -> argparse.ArgumentParser:
    """The parser of pretrain_gpt.py (or `gigatron pretrain`): Megatron's flag names and
    meanings, from the table."""
    return build_parser(prog, "Pretrain a GPT model with tensor, pipeline and "
                        "ZeRO parallelism. Every flag, its DeepSpeed key and default: "
                        "docs/FLAGS.md.")


def parse_flags(argv: Optional[Sequence[str]] = None,
                prog: str = "pretrain_gpt.py") -> argparse.Namespace:
    """Parse argv; unknown flags and bad values raise one ValueError naming them all."""
    flags = make_parser(prog).parse_args(argv)
    if flags.deepspeed_config is not None:
        ds = load_deepspeed_config(flags.deepspeed_config)
        try:
            flags = apply_deepspeed_config(ds, flags, _explicit_dests(argv))
        except ValueError as err:
            raise type(err)(*_prefixed(err, f"--deepspeed-config {flags.deepspeed_config}: ")) \
                from None
    return flags


def _prefixed(err: ValueError, prefix: str):
    """The args of `err` with every problem line prefixed (for ConfigError: its list)."""
    problems = getattr(err, "problems", None)
    if problems is not None:
        return ([prefix + line for line in problems],)
    return (prefix + str(err),)


def _explicit_dests(argv: Optional[Sequence[str]]) -> set:
    """The dests of the flags given on the command line (not left at their defaults)."""
    parser = make_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(argv)
    return set(vars(given)) - {r.dest for r in table() if not r.flag}


def zero_config(flags: argparse.Namespace, p: Optional[Problems] = None) -> Optional[ZeroConfig]:
    """The optimizer, mixed-precision, clipping and ZeRO flags as the ZeRO wrapper's config
    (None when invalid, with the problems in `p`; without `p` they raise)."""
    stage = flags.zero_stage if flags.zero_stage is not None else \
        (1 if flags.use_distributed_optimizer else 0)
    scale = flags.initial_loss_scale
    kw = dict(zero_stage=stage,
              # Megatron's --optimizer adam is AdamW (decoupled weight decay)
              optimizer="adamw" if flags.optimizer == "adam" else "sgd",
              lr=flags.lr, weight_decay=flags.weight_decay, adam_beta1=flags.adam_beta1,
              adam_beta2=flags.adam_beta2, adam_eps=flags.adam_eps,
              sgd_momentum=flags.sgd_momentum, clip_grad=flags.clip_grad,
              loss_scale=flags.loss_scale or 0.0,
              initial_scale_power=int(round(math.log2(scale))) if scale > 0 else 16,
              loss_scale_window=flags.loss_scale_window, hysteresis=flags.hysteresis,
              min_loss_scale=flags.min_loss_scale, grad_reduce_in_bf16=flags.grad_reduce_in_bf16,
              offload_optimizer="cpu" if flags.optimizer_cpu_offload else "none")
    for field in ("reduce_bucket_size", "overlap_comm", "consecutive_hysteresis"):
        if getattr(flags, ZERO_FLAGS[field]) is not None:  # else ZeroConfig's default
            kw[field] = getattr(flags, ZERO_FLAGS[field])
    own = p is None
    p = Problems() if p is None else p
    p.lines += zero_problems(kw, {f: flag_name(d) for f, d in ZERO_FLAGS.items()})
    if own:
        p.raise_if_any()
    return None if p or flags.lr is None else ZeroConfig(**kw)


def _parallel(flags: argparse.Namespace, dp: int) -> ParallelConfig:
    kw = values(ParallelConfig, flags)
    kw["sequence_parallel"] = bool(kw["sequence_parallel"] and kw["tp"] > 1)
    return ParallelConfig(**kw, dp=dp)


def _train(flags: argparse.Namespace, batches, train_iters: Optional[int] = None
           ) -> TrainConfig:
    mbs, gbs, num_mb = batches
    kw = {**values(TrainConfig, flags), "micro_batch_size": mbs, "global_batch_size": gbs,
          "num_microbatches": num_mb}
    if train_iters is not None:  # --train-samples: counted as Megatron counts them
        kw["train_iters"] = train_iters
    return TrainConfig(**kw)


def _microbatch_counts(batches, length, dp: int) -> List[int]:
    """Every micro-batch count a step will have (several under a batch ramp-up)."""
    if batches is None:
        return []
    if length is None:
        return [batches[2]]
    return sorted({b // (batches[0] * dp) for b in length[1].batch_sizes()})


def build_run_config(flags: argparse.Namespace, world_size: int,
                     vocab_size: Optional[int] = None) -> RunConfig:
    """Validate the flags together (every problem at once) and map them to the run's
    config objects."""
    p = Problems()
    tp, pp = flags.tensor_model_parallel_size, flags.pipeline_model_parallel_size
    dp = p.run(data_parallel_size, world_size, tp, pp)
    check_parallel(flags, p)
    model = build_model_config(flags, tp, vocab_size, p)
    batches = microbatches(flags, dp, p) if dp else None
    seq = model.seq_length if model is not None else None
    length = training_length(flags, batches[0] * dp, batches[1], p, seq) if batches else None
    parallel = _parallel(flags, dp or 1)
    check_train(flags, parallel, model, _microbatch_counts(batches, length, dp or 1), p)
    check_optimizer(flags, p)
    zero = zero_config(flags, p)
    lr_schedule = build_lr_schedule(flags, batches[1], p, seq) if batches else None
    check_data(flags, p)
    check_checkpointing(flags, p)
    check_logging(flags, p)
    check_operational(flags, p)
    p.raise_if_any()
    # raise_if_any: each of these was built
    assert model is not None and lr_schedule is not None and zero is not None and \
        length is not None
    data = GPTDataConfig(seq_length=model.seq_length, seed=flags.seed, data_path=flags.data_path,
                         split=flags.split, train_data_path=flags.train_data_path,
                         valid_data_path=flags.valid_data_path,
                         test_data_path=flags.test_data_path, mock_data=flags.mock_data,
                         data_cache_path=flags.data_cache_path,
                         eod_mask_loss=flags.eod_mask_loss, vocab_size=flags.vocab_size)
    return RunConfig(model=model, model_name=flags.model, parallel=parallel, zero=zero,
                     lr_schedule=lr_schedule, data=data, train=_train(flags, batches, length[0]),
                     checkpoint=CheckpointConfig(**values(CheckpointConfig, flags)),
                     logging=LoggingConfig(**values(LoggingConfig, flags)),
                     flags=dict(vars(flags)))


def parse_args(argv: Optional[Sequence[str]], world_size: int,
               vocab_size: Optional[int] = None) -> RunConfig:
    """parse_flags + build_run_config: argv to a validated RunConfig (unknown flags, bad
    values and inconsistent values all in one ConfigError)."""
    try:
        flags = parse_flags(argv)
    except ParseProblems as err:
        raise with_other_problems(err, world_size, vocab_size) from None
    return build_run_config(flags, world_size, vocab_size)


def with_other_problems(err: ParseProblems, world_size: int,
                        vocab_size: Optional[int] = None) -> ConfigError:
    """The command line's parse problems and, after them, those of the values that parsed
    (lines about a flag whose value was bad are left out: its line says it already)."""
    others: List[str] = []
    # with a DeepSpeed JSON the flags lack its values: the rest is checked once they parse
    if err.flags is not None and err.flags.deepspeed_config is None:
        try:
            build_run_config(err.flags, world_size, vocab_size)
        except ValueError as more:
            lines = getattr(more, "problems", str(more).splitlines())
            others = [line for line in lines
                      if not any(flag in line for flag in err.bad_flags)]
    return ConfigError(err.problems + others)
