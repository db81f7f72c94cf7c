"""`gigatron.initialize`: DeepSpeed's `deepspeed.initialize`, for any nn.Module.

    engine, optimizer, train_loader, lr_scheduler = gigatron.initialize(
        args=args, model=model, model_parameters=model.parameters(), config="ds.json")

Same names, signature and return values as DeepSpeed, so a DeepSpeed script runs with
`import gigatron as deepspeed`. It joins the process group itself (a world of one without a
launcher), moves the model to the device and to fp16/bf16 as configured, makes every rank
start from rank 0's weights, and builds ZeRO (stages 0-3, loss scaling, clipping, offload:
the implementation pretrain_gpt.py uses) over the parameters given.

A `gigatron.pipe.PipelineModule` gets a `PipelineEngine` (train_batch / eval_batch, DeepSpeed's
pipeline engine): ZeRO over its stage's chunks with the pipeline's process groups, the
batch arithmetic over its data-parallel size (world / pipeline stages), and each stage's
replicas starting from their data-parallel rank 0.
"""
from __future__ import annotations

import argparse
import json
from typing import Any, Callable, Iterable, Optional, Tuple, Union

import torch
from torch import nn

from gigatron.training.config.deepspeed.engine_config import EngineConfig
from gigatron.engine.deepspeed.data_loader import EngineDataLoader, pin_memory_default
from gigatron.engine.deepspeed.distributed import DistributedContext, init_distributed
from gigatron.engine.deepspeed.engine import _DTYPES, Engine, broadcast_module

ConfigSource = Union[str, dict, None]
# torch optimizers whose update is elementwise, so ZeRO's sharding cannot change it
_ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's flags: --deepspeed, --deepspeed_config (and --local_rank unless the
    script already has it); returns the parser, as DeepSpeed's does."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (gigatron)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="enable the engine (accepted for DeepSpeed scripts)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed JSON config file")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help=argparse.SUPPRESS)  # DeepSpeed's deprecated spellings
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    try:
        group.add_argument("--local_rank", "--local-rank", type=int, default=-1,
                           help="local rank (set by launchers; read from LOCAL_RANK too)")
    except argparse.ArgumentError:
        pass  # the script declares its own --local_rank, as DeepSpeed's tutorials do
    return parser


def initialize(args: Optional[argparse.Namespace] = None, model: Optional[nn.Module] = None,
               optimizer: Any = None, model_parameters: Optional[Iterable] = None,
               training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: ConfigSource = None, mesh_param: Any = None,
               config_params: ConfigSource = None
               ) -> Tuple[Engine, torch.optim.Optimizer, Any, Any]:
    """(engine, optimizer, training_dataloader, lr_scheduler), as DeepSpeed returns them."""
    from gigatron.training.config.deepspeed.engine import engine_config
    from gigatron.training.config.validation import ConfigError

    from gigatron.engine.pipe.module import PipelineModule

    module = _check_model(model)
    if mpu is not None or mesh_param is not None:
        raise ValueError("initialize(mpu=..., mesh_param=...) are not supported: build a "
                         "gigatron.pipe.PipelineModule (its topology= sets tp x dp x pp); "
                         "leave them None")
    ctx = init_distributed()
    pipe = module if isinstance(module, PipelineModule) else None
    dp_rank, dp_size = (pipe.dp_rank, pipe.dp_size) if pipe else (ctx.rank, ctx.world_size)
    source = _config_source(args, config, config_params)
    try:
        cfg = engine_config(source, ctx.world_size, dp_world_size=dp_size, model=module,
                            args=args)
    except ConfigError as err:  # the user's config: its lines, not the reader's frames
        raise err.with_traceback(None) from None
    module.to(ctx.device, dtype=_DTYPES[cfg.precision])
    if pipe is not None:
        pipe.broadcast_from_data_parallel_source()
    else:
        broadcast_module(module)
    zero = _build_zero(module, cfg, optimizer, model_parameters, pipe)
    scheduler = _scheduler(lr_scheduler, cfg, zero.optimizer)
    loader = (EngineDataLoader(training_data, cfg.train_micro_batch_size_per_gpu, dp_rank,
                               dp_size, collate_fn, pin_memory=pin_memory_default(ctx.device))
              if training_data is not None else None)
    if pipe is not None:
        from gigatron.engine.pipe.engine import PipelineEngine

        engine: Engine = PipelineEngine(pipe, zero, cfg, ctx, scheduler, loader)
    else:
        engine = Engine(module, zero, cfg, ctx, scheduler, loader)
    _log_config(cfg, ctx, pipe)
    return engine, engine.optimizer, loader, scheduler


def _check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise ValueError(f"initialize(model=...) needs a torch.nn.Module, got "
                         f"{type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"initialize(model=...): {type(model).__name__} has no trainable "
                         f"parameters, so there is nothing to train")
    return model


def _config_source(args: Optional[argparse.Namespace], config: ConfigSource,
                   config_params: ConfigSource) -> Union[str, dict]:
    """The config from `config`, `config_params` or args.deepspeed_config (one of them)."""
    from_args = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config",
                                                                   None)
    given = [c for c in (config, config_params, from_args) if c is not None]
    if not given:
        raise ValueError("initialize: no config: pass config='ds_config.json' (or a dict), or "
                         "args with --deepspeed_config (see gigatron.add_config_arguments)")
    if len(given) > 1 and not all(json.dumps(g, sort_keys=True, default=str) ==
                                  json.dumps(given[0], sort_keys=True, default=str)
                                  for g in given):
        raise ValueError("initialize: the config is given twice (config/config_params and "
                         "args.deepspeed_config) with different values: give it once")
    return given[0]


def _build_zero(module: nn.Module, cfg: EngineConfig, optimizer: Any,
                model_parameters: Optional[Iterable], pipe: Any = None) -> Any:
    from gigatron.parallel.zero import build_zero
    from gigatron.parallel.zero.config import zero3_pipeline_problem

    if optimizer is None and cfg.optimizer is None:
        raise ValueError('no optimizer: give an "optimizer" section in the config (e.g. '
                         '{"type": "AdamW", "params": {"lr": 1e-3}}) or pass optimizer= to '
                         'initialize')
    if optimizer is not None and cfg.optimizer is not None:
        raise ValueError('an optimizer is given twice: the config has an "optimizer" section '
                         'and initialize got optimizer=...; keep one (DeepSpeed refuses too)')
    if isinstance(optimizer, torch.optim.Optimizer) and cfg.zero.zero_stage > 0 and not \
            isinstance(optimizer, _ELEMENTWISE) and not cfg.zero_allow_untested_optimizer:
        raise ValueError(
            f"{type(optimizer).__name__} under ZeRO stage {cfg.zero.zero_stage}: ZeRO shards "
            f"each parameter over the ranks, which is exact only for optimizers whose update "
            f"is elementwise (Adam, AdamW, SGD, Adagrad; Lamb from the config); set "
            f"\"zero_allow_untested_optimizer\": true to use it anyway, as DeepSpeed requires")
    pipelined = pipe is not None and zero3_pipeline_problem(
        cfg.zero.zero_stage, pipe.num_stages, "zero_optimization.stage",
        "a PipelineModule's num_stages")
    if pipelined:
        raise ValueError(pipelined)
    params = list(model_parameters) if model_parameters is not None else None
    if cfg.optimizer is not None and cfg.optimizer.type == "muon":  # DeepSpeed's use_muon
        from gigatron.engine.deepspeed.muon import muon_param_groups, tag_use_muon

        tag_use_muon(module)
        params = muon_param_groups(params, module, cfg.optimizer)
    # a pipeline: one flat-buffer set per virtual stage, reduced over its own groups
    chunks = pipe.chunks if pipe is not None else module
    groups = pipe.groups if pipe is not None else None
    return build_zero(chunks, cfg.zero, groups, param_groups=params,
                      optimizer=optimizer if optimizer is not None else cfg.optimizer)


def _scheduler(lr_scheduler: Any, cfg: EngineConfig, optimizer: torch.optim.Optimizer) -> Any:
    """The user's scheduler (or factory), else the config's; None when neither."""
    if lr_scheduler is not None and cfg.scheduler is not None:
        raise ValueError('a learning-rate scheduler is given twice: the config has a '
                         '"scheduler" section and initialize got lr_scheduler=...; keep one')
    if lr_scheduler is not None:
        return lr_scheduler(optimizer) if callable(lr_scheduler) and not hasattr(
            lr_scheduler, "step") else lr_scheduler
    if cfg.scheduler is None:
        return None
    from gigatron.training.lr.deepspeed import build_scheduler

    return build_scheduler(cfg.scheduler, optimizer)


def _log_config(cfg: EngineConfig, ctx: DistributedContext, pipe: Any = None) -> None:
    """Once, on rank 0: where it runs, and the config with every "auto" resolved."""
    if ctx.rank != 0:
        return
    print(f"[gigatron] engine: {ctx.world_size} rank{'s' if ctx.world_size > 1 else ''} on "
          f"{ctx.device.type}, ZeRO stage {cfg.zero.zero_stage}, {cfg.precision}, batch "
          f"{cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu} x "
          f"accumulation {cfg.gradient_accumulation_steps} x " + (
              f"{ctx.world_size} ranks" if pipe is None else
              f"{pipe.dp_size} data-parallel replicas of {pipe.num_stages} pipeline stages"),
          flush=True)
    if ctx.device.type == "cpu" and cfg.precision != "fp32":
        print(f"[gigatron] {cfg.precision} on a CPU: it runs and its numerics are those of "
              f"{cfg.precision}, but CPUs have no fast {cfg.precision} math"
              f"{'; bf16 needs no loss scaling' if cfg.precision == 'fp16' else ''}",
              flush=True)
    for line in cfg.info:
        print(f"[gigatron] {line}", flush=True)
    if cfg.resolved:
        print(f"[gigatron] config: {json.dumps(cfg.resolved, sort_keys=True)}", flush=True)
