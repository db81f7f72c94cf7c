"""Megatron's command-line flags, the ONE place where flags become config objects.

`make_parser()` is generated from the config table (`training/config/table.py`);
`parse_flags(argv)` reads the flags (every unknown flag and bad value at once, with the
nearest known flag) and fills the ones not given from `--deepspeed-config`;
`table.build_settings` types them, once. `build_run(settings, world_size)` is the one entry
that validates them: every check of `validation.py`, the tokenizer the data settings name,
the model, batches, schedule and ZeRO config, each problem once, one ConfigError with a line
per problem naming the flag and the fix, before any process group, model or data is
touched. Parsing imports no torch: `pretrain_gpt.py --help` stays instant.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

from gigatron.training.config.run_config import LRScheduleConfig, ParallelConfig, RunConfig
from gigatron.training.config.table import (ParseProblems, Settings, build_parser,
                                            build_settings, flag_name, table)
from gigatron.training.config.validation import ConfigError, Problems

if TYPE_CHECKING:
    from gigatron.data.tokenizer import Tokenizer
    from gigatron.models.config import TransformerConfig
    from gigatron.parallel.world import LaunchEnv
    from gigatron.parallel.zero import ZeroConfig
    from gigatron.training.config.settings import DataSettings
    from gigatron.training.run.batch_rampup import BatchRampup

# ZeroConfig field -> the flag dest it is computed from (names its problems)
ZERO_FLAGS = {"zero_stage": "zero_stage", "optimizer": "optimizer", "lr": "lr",
              "weight_decay": "weight_decay", "adam_beta1": "adam_beta1",
              "adam_beta2": "adam_beta2", "adam_eps": "adam_eps",
              "sgd_momentum": "sgd_momentum", "clip_grad": "clip_grad",
              "loss_scale": "loss_scale", "initial_scale_power": "initial_loss_scale",
              "loss_scale_window": "loss_scale_window", "hysteresis": "hysteresis",
              "min_loss_scale": "min_loss_scale", "grad_reduce_dtype": "grad_reduce_in_bf16",
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
    from gigatron.training.config.deepspeed.pretrain import (apply_deepspeed_config,
                                                             load_deepspeed_config)

    flags = make_parser(prog).parse_args(argv)
    read_data_args(flags)
    if flags.use_checkpoint_args and flags.load is not None:
        from gigatron.training.checkpoint.checkpoint_args import apply_checkpoint_args

        apply_checkpoint_args(flags, given_dests(argv, prog))
    if flags.deepspeed_config is not None:
        ds = load_deepspeed_config(flags.deepspeed_config)
        try:
            flags = apply_deepspeed_config(ds, flags, given_dests(argv, prog))
        except ValueError as err:
            raise type(err)(*_prefixed(err, f"--deepspeed-config {flags.deepspeed_config}: ")) \
                from None
    return flags


def read_data_args(flags: argparse.Namespace) -> None:
    """--data-args-path / --per-split-data-args-path: the data paths read from a file in
    place of --data-path / --train/valid/test-data-path, as Megatron-LM's
    get_blend_and_blend_per_split reads them (the file's words; the JSON's three splits)."""
    import json

    def words(flag: str, path: str) -> Any:
        try:
            with open(path) as f:
                return f.read() if flag == "--data-args-path" else json.load(f)
        except (OSError, ValueError) as err:
            raise ValueError(f"{flag} {path}: cannot read it ({err}): give a readable "
                             f"file") from None

    if flags.data_args_path is not None:
        if flags.data_path is not None:
            raise ValueError("--data-args-path and --data-path are exclusive (Megatron-LM "
                             "asserts it): give the paths one way")
        flags.data_path = words("--data-args-path", flags.data_args_path).split()
    if flags.per_split_data_args_path is not None:
        given = [f"--{n}-data-path" for n in ("train", "valid", "test")
                 if getattr(flags, f"{n}_data_path") is not None]
        if given:
            raise ValueError(f"--per-split-data-args-path and {', '.join(given)} are "
                             f"exclusive (Megatron-LM asserts it): give the paths one way")
        splits = words("--per-split-data-args-path", flags.per_split_data_args_path)
        for name in ("train", "valid", "test"):
            if not isinstance(splits, dict) or name not in splits:
                raise ValueError(f"--per-split-data-args-path {flags.per_split_data_args_path}"
                                 f": needs the keys train, valid and test")
            value = splits[name]
            setattr(flags, f"{name}_data_path",
                    value.split() if isinstance(value, str) else list(value))


def _prefixed(err: ValueError, prefix: str) -> Tuple:
    """The args of `err` with every problem line prefixed (for ConfigError: its list)."""
    problems = getattr(err, "problems", None)
    if problems is not None:
        return ([prefix + line for line in problems],)
    return (prefix + str(err),)


def given_dests(argv: Optional[Sequence[str]], prog: str = "pretrain_gpt.py") -> Set[str]:
    """The dests of the flags `argv` gives (not left at their defaults): the one answer to
    "which flags were given", for the DeepSpeed JSON and for a run rebuilt from a checkpoint."""
    parser = make_parser(prog)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    given, _ = parser.parse_known_args(None if argv is None else list(argv))
    return set(vars(given)) - {r.dest for r in table() if not r.flag}


def zero_config(s: Settings, p: Problems, model: Optional["TransformerConfig"] = None
                ) -> Optional["ZeroConfig"]:
    """The optimizer, mixed-precision, clipping and ZeRO settings as the ZeRO wrapper's config
    (None when invalid, with the problems in `p`)."""
    from gigatron.parallel.zero.config import ZeroConfig, megatron_grad_dtype, zero_problems
    from gigatron.training.config.megatron.muon import muon_config

    precision, o = s.precision, s.optimizer
    stage = precision.zero_stage if precision.zero_stage is not None else \
        (1 if precision.use_distributed_optimizer else 0)
    scale = precision.initial_loss_scale
    kw: Dict[str, Any] = dict(
        zero_stage=stage,
        optimizer={"adam": "adamw"}.get(o.optimizer, o.optimizer),  # Megatron's adam: AdamW
        muon=muon_config(s, model, p),
        lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, sgd_momentum=o.sgd_momentum,
        clip_grad=o.clip_grad, loss_scale=precision.loss_scale or 0.0,
        initial_scale_power=int(round(math.log2(scale))) if scale > 0 else 16,
        loss_scale_window=precision.loss_scale_window, hysteresis=precision.hysteresis,
        min_loss_scale=precision.min_loss_scale,
        grad_reduce_dtype=megatron_grad_dtype(
            "bf16" if precision.bf16 else "fp16" if precision.fp16 else "fp32",
            precision.accumulate_allreduce_grads_in_fp32, precision.grad_reduce_in_bf16),
        offload_optimizer="cpu" if precision.optimizer_cpu_offload else "none",
        overlap_param_gather=precision.overlap_param_gather)
    for field in ("reduce_bucket_size", "overlap_comm", "consecutive_hysteresis"):
        if s.value(ZERO_FLAGS[field]) is not None:  # else ZeroConfig's default
            kw[field] = s.value(ZERO_FLAGS[field])
    p.lines += zero_problems(kw, {f: flag_name(d) for f, d in ZERO_FLAGS.items()})
    return None if p or o.lr is None else ZeroConfig(**kw)


def _tokenizer(data: "DataSettings", p: Problems) -> Tuple[bool, Optional["Tokenizer"]]:
    """(whether the data settings name a tokenizer, that tokenizer): the type given, or
    Megatron's default unless --mock-data goes without one. A tokenizer that cannot be built
    is one line in `p`; whether the data paths are right does not matter to it."""
    from gigatron.data.tokenizer import missing_tokenizer_flags, tokenizer_from_flags

    options = dataclasses.asdict(data)
    tokenizer_type, missing = missing_tokenizer_flags(options)
    if tokenizer_type is None:
        return False, None
    if missing:
        default = "" if data.tokenizer_type else " (Megatron's default when --tokenizer-type " \
            "is not given)"
        p.add(f"--tokenizer-type {tokenizer_type}{default} needs "
              f"{', '.join(flag_name(d) for d in missing)}")
        return True, None
    return True, p.run(tokenizer_from_flags, options, tokenizer_type)


def _null_tokenizer(data: "DataSettings", vocab_size: int) -> Optional["Tokenizer"]:
    """--mock-data without a tokenizer: a null tokenizer of --vocab-size (else the model's
    vocabulary) whose eod is its last id, as Megatron-Core's."""
    from gigatron.data.tokenizer import NullTokenizer

    vocab = data.vocab_size or vocab_size
    return NullTokenizer(vocab, data.null_tokenizer_eod_id) if vocab >= 2 else None


def _microbatch_counts(batches: Optional[Tuple[int, int, int]],
                       length: Optional[Tuple[int, "BatchRampup"]], dp: int) -> List[int]:
    """Every micro-batch count a step will have (several under a batch ramp-up)."""
    if batches is None:
        return []
    if length is None:
        return [batches[2]]
    return sorted({b // (batches[0] * dp) for b in length[1].batch_sizes()})


def _launch_fits(s: Settings, launch: Optional["LaunchEnv"], p: Problems) -> bool:
    """--local-rank against the launcher's, and the ranks a plain `python pretrain_gpt.py`
    lacks (then the world size says nothing of the layout: False)."""
    from gigatron.parallel.world import require_world_size
    from gigatron.training.config.features import check_local_rank

    if launch is None:
        return True
    p.run(check_local_rank, s.parallel.local_rank, launch.local_rank, launch.launcher)
    n = len(p.lines)
    if launch.launcher == "none":
        p.run(require_world_size, launch,
              s.parallel.tp * s.parallel.context_parallel_size * s.parallel.pp)
    return len(p.lines) == n


def build_run(s: Settings, world_size: int, tokenizer: Optional["Tokenizer"] = None,
              launch: Optional["LaunchEnv"] = None) -> Tuple[RunConfig, Optional["Tokenizer"]]:
    """Validate the settings together (every problem at once, none that only follows from
    another) and resolve them into the run's configs, with the tokenizer the data settings
    name (`tokenizer`: that one, already built by the caller; None: built here). `launch`:
    how this process was started, checked too (pretrain_gpt.py's ranks)."""
    from gigatron.training.config.features import check_operational
    from gigatron.training.config.megatron.model import build_model_config
    from gigatron.training.config.megatron.context_parallel import context_parallel_problems
    from gigatron.training.config.megatron.moe import expert_parallel_problems
    from gigatron.training.config.megatron.schedule import build_lr_schedule, training_length
    from gigatron.training.config.validation import (check_checkpointing, check_data,
                                                     check_logging, check_optimizer,
                                                     check_parallel, check_train,
                                                     data_parallel_size, microbatches)

    p = Problems()
    dp = p.run(data_parallel_size, world_size, s.parallel.tp, s.parallel.pp,
               s.parallel.context_parallel_size) if _launch_fits(s, launch, p) else None
    check_parallel(s, p)
    check_data(s.data, p)
    named = tokenizer is not None
    if tokenizer is None:
        named, tokenizer = _tokenizer(s.data, p)
    model = build_model_config(s, tokenizer.vocab_size if tokenizer else None, p, named)
    batches = microbatches(s, dp, p) if dp else None
    seq = model.seq_length if model is not None else None
    micro_times_dp, global_batch = (batches[0] * dp, batches[1]) if batches and dp \
        else (None, None)
    length = training_length(s, micro_times_dp, global_batch, p, seq)
    expert_parallel_problems(s, dp, _num_experts(s, model), p)
    context_parallel_problems(s, model, p)
    parallel = ParallelConfig(**{**dataclasses.asdict(s.parallel), "dp": dp or 1,
                                 "sequence_parallel": s.parallel.sequence_parallel and
                                 s.parallel.tp > 1,
                                 "etp": s.parallel.etp or s.parallel.tp})
    check_train(s, parallel, model, _microbatch_counts(batches, length, dp or 1), p)
    check_optimizer(s, p)
    zero = zero_config(s, p, model)
    lr_schedule = build_lr_schedule(s, global_batch, p, seq)
    check_checkpointing(s, p)
    check_logging(s, p)
    check_operational(s, p)
    from gigatron.training.config.deepspeed.pretrain import in_json_words

    p.lines = in_json_words(p.lines, s.source.deepspeed_config)  # the keys the user wrote
    p.raise_if_any()
    # raise_if_any: each of these was built
    assert model is not None and lr_schedule is not None and zero is not None and \
        length is not None and batches is not None
    return _run_config(s, model, parallel, zero, lr_schedule, batches, length[0]), \
        tokenizer or _null_tokenizer(s.data, model.vocab_size)


def _num_experts(s: Settings, model: Optional["TransformerConfig"]) -> Optional[int]:
    """The model's routed experts per MoE layer (when the model did not build: the flag's,
    else the --model zoo config's, so that its other problems do not also call it dense)."""
    if model is not None:
        return getattr(model, "num_moe_experts", None)
    if s.moe.num_experts is not None or s.model.model is None:
        return s.moe.num_experts
    from gigatron.models.zoo import list_models, model_fields

    return model_fields(s.model.model).get("num_moe_experts") \
        if s.model.model in list_models() else None


def _run_config(s: Settings, model: "TransformerConfig", parallel: ParallelConfig,
                zero: "ZeroConfig", lr_schedule: LRScheduleConfig,
                batches: Tuple[int, int, int], train_iters: int) -> RunConfig:
    """The RunConfig of validated settings and what was resolved from them."""
    from gigatron.data.builder import GPTDataConfig

    d = s.data
    data = GPTDataConfig(seq_length=model.seq_length, seed=s.train.seed,
                         data_path=d.data_path, split=d.split,
                         train_data_path=d.train_data_path, valid_data_path=d.valid_data_path,
                         test_data_path=d.test_data_path, mock_data=d.mock_data,
                         data_cache_path=d.data_cache_path, eod_mask_loss=d.eod_mask_loss,
                         reset_position_ids=d.reset_position_ids,
                         reset_attention_mask=d.reset_attention_mask, vocab_size=d.vocab_size,
                         sft=d.sft, tokenizer_model=d.tokenizer_model,
                         context_parallel_size=parallel.context_parallel_size)
    mbs, gbs, num_mb = batches
    # --train-samples: the iterations counted as Megatron counts them
    train = dataclasses.replace(s.train, micro_batch_size=mbs, global_batch_size=gbs,
                                num_microbatches=num_mb, train_iters=train_iters)
    return RunConfig(model=model, parallel=parallel, zero=zero, lr_schedule=lr_schedule,
                     data=data, train=train, checkpoint=s.checkpoint, logging=s.logging,
                     settings=s)


def build_run_config(flags: argparse.Namespace, world_size: int,
                     tokenizer: Optional["Tokenizer"] = None) -> RunConfig:
    """`build_run` of parsed flags, without the tokenizer (for tools and tests)."""
    return build_run(build_settings(flags), world_size, tokenizer)[0]


def read_settings(argv: Optional[Sequence[str]], world_size: int,
                  prog: str = "pretrain_gpt.py") -> Settings:
    """The typed settings of a command line; its parse problems raise as one ConfigError with
    the problems of the values that did parse (`with_other_problems`)."""
    try:
        return build_settings(parse_flags(argv, prog))
    except ParseProblems as err:
        raise with_other_problems(err, world_size) from None


def parse_args(argv: Optional[Sequence[str]], world_size: int) -> RunConfig:
    """A command line to its validated RunConfig (unknown flags, bad values and inconsistent
    values all in one ConfigError)."""
    return build_run(read_settings(argv, world_size), world_size)[0]


def with_other_problems(err: ParseProblems, world_size: int) -> ConfigError:
    """The command line's parse problems and, after them, those of the values that parsed
    (lines about a flag whose value was bad are left out: its line says it already)."""
    others: List[str] = []
    # with a DeepSpeed JSON the flags lack its values: the rest is checked once they parse
    if err.flags is not None and err.flags.deepspeed_config is None:
        try:
            build_run(build_settings(err.flags), world_size)
        except ValueError as more:
            lines = getattr(more, "problems", str(more).splitlines())
            others = [line for line in lines
                      if not any(flag in line for flag in err.bad_flags)]
    return ConfigError(err.problems + others)
