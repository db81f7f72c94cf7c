"""Pretrain a GPT model with tensor, pipeline and ZeRO data parallelism (Megatron's flags).

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 \
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 256 \
        --num-attention-heads 8 --seq-length 128 --micro-batch-size 4 --global-batch-size 32 \
        --train-iters 200 --lr 3e-4 --data-path data/corpus_text_document \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model data/spm.model \
        --save ckpt --metrics-file ckpt/metrics.jsonl

Flags are validated together before any process group exists: a bad combination exits
with one line naming the flags. `--model NAME` starts from a zoo config;
`--deepspeed-config ds.json` reads a DeepSpeed JSON config into the same flags.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

if TYPE_CHECKING:
    from gigatron.data.tokenizer import Tokenizer
    from gigatron.parallel.world import LaunchEnv
    from gigatron.parallel.watchdog import Watchdog
    from gigatron.training.config.run_config import ParallelConfig, RunConfig
    from gigatron.training.config.settings import PrecisionSettings


def _configure(argv: Optional[List[str]], launch: "LaunchEnv", prog: str = "pretrain_gpt.py"
               ) -> Tuple["RunConfig", Optional["Tokenizer"]]:
    """Flags -> (RunConfig, tokenizer); raises ValueError with one clear line per problem."""
    from gigatron.training.config.arguments import build_run, read_settings

    settings = read_settings(argv, launch.world_size, prog)  # --help ends here, torch unread
    run, tokenizer = build_run(settings, launch.world_size, launch=launch)
    from gigatron.parallel.world import device_and_backend
    from gigatron.training.run.preflight import check_run_fits

    check_run_fits(run, device_and_backend(launch.local_rank)[0], os.environ)
    return run, tokenizer


def _seed(seed: int, pp_rank: int) -> None:
    """Megatron's seeding: one seed per pipeline stage, the same across tp and dp."""
    import random

    import numpy as np
    import torch

    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def matmul_precision(precision: "PrecisionSettings") -> None:
    """--disable-bf16-reduced-precision-matmul with --bf16: what Megatron-Core's
    TransformerConfig sets (CUDA only; CPU GEMMs do not reduce in lower precision)."""
    if precision.bf16 and precision.disable_bf16_reduced_precision_matmul:
        import torch

        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def logging_level(level: Optional[int]) -> None:
    """--logging-level (else MEGATRON_LOGGING_LEVEL) on the root logger, as Megatron-LM's
    initialize does; neither given: left as it is."""
    import logging

    if level is None and os.environ.get("MEGATRON_LOGGING_LEVEL") is not None:
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    if level is not None:
        logging.getLogger().setLevel(level)


def _build_session(run, tokenizer, launch, device, started: Optional[float] = None):
    """Everything the loop needs; `started`: the program's start (--exit-duration-in-mins)."""
    from gigatron.training.run import builders
    from gigatron.training.observe import flops as metrics
    from gigatron.training.checkpoint import orchestrator
    from gigatron.training.observe.logger import MetricsLogger
    from gigatron.training.run.compile import (CompileTimeNote, compile_model_chunks,
                                               compile_wanted)
    from gigatron.training.run.loop import Session
    from gigatron.training.observe.timers import TimedGradSync, Timers, device_sync, time_module_forward

    p = run.parallel
    groups = builders.build_process_groups(run, launch.rank, timeout=timedelta(
        minutes=p.distributed_timeout_minutes))
    _seed(run.train.seed, groups.index("pp"))
    matmul_precision(run.settings.precision)
    logging_level(run.logging.logging_level)
    chunks = builders.build_model_chunks(run, groups, device)
    compiling = compile_wanted(run.settings.implementation.torch_compile, device)
    if compiling:  # --torch-compile: each layer and the loss (training/run/compile.py)
        compile_model_chunks(chunks)
    shard = orchestrator.load_model_weights(run, groups, chunks)
    zero = builders.build_optimizer(run, chunks, groups)
    zero.count_zeros_in_grad = run.logging.log_num_zeros_in_grad
    progress = orchestrator.restore_training_state(run, shard, chunks, zero, device)
    schedule, schedule_note = orchestrator.resumed_schedule(run, shard)
    run = replace(run, lr_schedule=schedule)
    timers = Timers(device_sync(device) if run.logging.timing_log_level >= 1 else None)
    for chunk in chunks:
        time_module_forward(chunk, timers)
    grad_sync = TimedGradSync(zero, timers)
    pipeline = builders.build_pipeline(run, groups, chunks, grad_sync, device, timers)
    datasets = builders.build_datasets(run, tokenizer)
    log = run.logging
    logger = MetricsLogger(launch.rank == 0, run.train.train_iters, log.metrics_file,
                           log.tensorboard_dir, log.progress, append=progress.iteration > 0,
                           start_iteration=progress.iteration, wandb=_wandb_options(run))
    if progress.iteration > 0:
        logger.truncate_after(progress.iteration)
    if schedule_note:
        logger.print(schedule_note)
    peak = log.peak_tflops or metrics.device_peak_tflops(device, run.model.params_dtype)
    session = Session(run, groups, device, chunks, zero, grad_sync, pipeline, datasets, logger,
                      timers, metrics.flops_per_token(run.model, p.tp), peak,
                      started=time.monotonic() if started is None else started,
                      start_samples=progress.consumed_train_samples,
                      compile_note=CompileTimeNote(compiling))
    return session, progress, shard


def _wandb_options(run: "RunConfig") -> Optional[Dict[str, Any]]:
    """wandb.init's arguments for --wandb-project (Megatron's: the folder defaults to
    --save/wandb, the config is every setting by its flag's dest); None without it."""
    log = run.logging
    if not log.wandb_project:
        return None
    folder = log.wandb_save_dir or (os.path.join(run.checkpoint.save, "wandb")
                                    if run.checkpoint.save else None)
    return {"project": log.wandb_project, "name": log.wandb_exp_name, "dir": folder,
            "config": {k: v for k, v in run.flags.items() if isinstance(
                v, (int, float, str, bool, list, type(None)))}}


def _ranks_phrase(world_size: int, launcher: str) -> str:
    """'1 rank (no launcher)', '8 ranks (torchrun)': the banner in English."""
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    return f"{ranks} ({'no launcher' if launcher == 'none' else launcher})"


def _active_phrase(config) -> str:
    """' (36,625,603,584 active)' for a mixture of experts (models/gpt.py's convention)."""
    from gigatron.models.gpt import count_active_parameters

    if not config.num_moe_experts:
        return ""
    return f" ({count_active_parameters(config):,} active)"


def _banner(s, progress, shard, launch, device) -> None:
    import torch.distributed as dist
    from gigatron.models.gpt import count_parameters
    from gigatron.parallel.launcher.progress import note_progress
    from gigatron.training.run.builders import partition
    from gigatron.data.builder import describe_datasets
    from gigatron.training.config.features import flag_notes
    from gigatron.training.run.banner import parallel_line
    from gigatron.training.run.preflight import device_notes

    run, p, t = s.run, s.run.parallel, s.run.train
    s.logger.print(
        f"gigatron: {_ranks_phrase(launch.world_size, launch.launcher)} on {device.type}, "
        f"tp={p.tp} pp={p.pp} dp={p.dp}{_context_phrase(p)} "
        f"zero stage {run.zero.zero_stage}"
        f"{' sequence-parallel' if p.sequence_parallel else ''}\n"
        f"model: {run.model_name or 'custom'}, {count_parameters(run.model):,} parameters"
        f"{_active_phrase(run.model)}, "
        f"{run.model.num_layers} layers, hidden {run.model.hidden_size}, seq "
        f"{run.model.seq_length}, vocab {run.model.vocab_size}, "
        f"{str(run.model.params_dtype).replace('torch.', '')}\n"
        f"batch: global {t.global_batch_size} = micro {t.micro_batch_size} x dp {p.dp} x "
        f"{t.num_microbatches} micro-batches; {s.flops_per_token / 1e6:.2f} MFLOP/token\n"
        f"{_architecture(run.model)}{_rampup_phrase(t)}\n"
        f"{parallel_line(run, partition(run).virtual_chunks)}\n"
        f"{partition(run).describe()}")
    plan_lines, s.memory_plan = _memory_plan(run, device)
    for line in device_notes(device, dist.get_backend(), run, os.environ) + \
            flag_notes(run.settings, dist.get_backend()) + plan_lines + \
            describe_datasets(s.datasets):
        s.logger.print(line)
    if shard is not None:
        s.logger.print(f"loaded checkpoint {shard['_folder']} (iteration {progress.iteration}, "
                       f"{progress.consumed_train_samples} samples consumed)")
        note_progress(saved=progress.iteration)  # what a restart resumes from, at least
    elif run.checkpoint.load:
        s.logger.print(f"no checkpoint in --load {run.checkpoint.load}: training from scratch")


def _memory_plan(run, device) -> Tuple[List[str], Dict[int, float]]:
    """gigatron plan's memory prediction per pipeline stage: the banner's lines and the
    predicted peak bytes per stage (on CUDA the loop prints the measured peak beside it after
    the first log line)."""
    from gigatron.training.run.builders import partition
    from gigatron.training.plan.memory import plan_memory
    from gigatron.training.plan.planner import context_of
    from gigatron.training.plan.report import startup_lines

    p, t = run.parallel, run.train
    stages = plan_memory(run.model, partition(run), p.tp, p.dp, run.zero, t.micro_batch_size,
                         t.num_microbatches, on_gpu=device.type == "cuda", ep=p.ep, etp=p.etp,
                         context=context_of(run), schedule=p.pipeline_schedule)
    return startup_lines(stages), {m.pp_rank: float(m.peak) for m in stages}


def _architecture(model) -> str:
    """'mlp gelu_tanh, positions learned_absolute, LayerNorm, 12 heads x 64 (4 kv groups)';
    multi-latent attention: its head sizes and latents instead (kv_channels plays no part)."""
    heads = (f"{model.num_attention_heads} heads x {model.kv_channels} "
             f"({model.num_query_groups} kv groups)")
    if model.multi_latent_attention:
        q_latent = f", query latent {model.q_lora_rank}" if model.q_lora_rank else ""
        heads = (f"multi-latent attention, {model.num_attention_heads} heads x q/k "
                 f"{model.qk_head_dim}+{model.qk_pos_emb_head_dim} / v {model.v_head_dim} "
                 f"(key/value latent {model.kv_lora_rank}{q_latent})")
    return (f"mlp {model.activation}, positions {model.position_embedding_type}, "
            f"{model.normalization}, {heads}")


def _rampup_phrase(t) -> str:
    """'; batch ramp-up 16 -> 1536 by 16 over 5859375 samples' (empty without a ramp)."""
    if not t.rampup_batch_size:
        return ""
    start, increment, samples = t.rampup_batch_size
    return (f"; batch ramp-up {start} -> {t.global_batch_size} by {increment} over {samples} "
            f"samples, {t.train_iters} iterations")


def _summary(s, progress, wall_seconds: float) -> None:
    """The end-of-run block and its summary record: time, tokens, losses, speed, where.
    Every rank calls it (peak memory is the largest rank's); rank 0 prints and records."""
    from gigatron.training.run.loop import max_over_ranks
    from gigatron.training.observe.flops import peak_memory_bytes, throughput

    run, totals, seq = s.run, s.logger.totals, s.run.model.seq_length
    (peak_memory,) = max_over_ranks(s, [peak_memory_bytes(s.device)])
    record = {
        "iteration": progress.iteration, "consumed_samples": progress.consumed_train_samples,
        "skipped_iterations": progress.skipped_iterations, "wall_seconds": wall_seconds,
        "tokens_this_run": (progress.consumed_train_samples - s.start_samples) * seq,
        "tokens_total": progress.consumed_train_samples * seq,
        "train_steps": totals.train_steps, "train_seconds": totals.train_seconds,
        **throughput(totals.train_samples * seq, totals.train_seconds,
                     s.flops_per_token, run.parallel.world_size, s.peak_tflops),
        "peak_memory_mib": peak_memory / 2 ** 20,
        **totals.loss_fields("valid"), **totals.loss_fields("test"), **_summary_paths(s)}
    s.logger.summary(record)


def _summary_paths(s) -> dict:
    """Where the run's outputs are (absolute paths; None for those not asked for)."""
    log = s.run.logging
    checkpoint = None
    if s.saved_iterations:
        from gigatron.training.checkpoint.folders import iteration_dir
        checkpoint = os.path.abspath(iteration_dir(s.run.checkpoint.save,
                                                   s.saved_iterations[-1]))
    return {"checkpoint": checkpoint,
            "metrics_file": os.path.abspath(log.metrics_file) if log.metrics_file else None,
            "tensorboard_dir": os.path.abspath(log.tensorboard_dir)
            if log.tensorboard_dir else None}


def main(argv: Optional[List[str]] = None, prog: str = "pretrain_gpt.py") -> int:
    """Pretrain from Megatron's flags; `prog` names the program in usage and error lines."""
    from gigatron.parallel.world import init_distributed, read_launch_env

    started = time.monotonic()  # the summary's wall time counts start-up too
    rank = 0
    try:
        launch = read_launch_env()
        rank = launch.rank
        run, tokenizer = _configure(argv, launch, prog)
    except ValueError as err:
        if rank == 0:  # every rank finds the same error: one copy is enough
            print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    import torch.distributed as dist
    from gigatron.training.run.loop import train

    launch, device = init_distributed(run.parallel.distributed_timeout_minutes)
    watchdog = _start_watchdog(launch, run.parallel.distributed_timeout_minutes)
    status = "failed"
    try:
        _start_timeline(run, launch)
        session, progress, shard = _build_session(run, tokenizer, launch, device, started)
        _name_timeline_rank(session)
        _banner(session, progress, shard, launch, device)
        progress = train(session, progress)
        _summary(session, progress, time.monotonic() - started)
        session.logger.close()
        status = "done"
    except ValueError as err:  # layout/checkpoint mismatches found after launch
        from gigatron.training.run.errors import should_print

        if should_print(str(err), launch.rank, watchdog):  # once when every rank finds it
            print(f"{prog}: error (rank {launch.rank}): {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # a collective failed: name the rank that caused it
        return _peer_failure(err, watchdog, launch.rank, prog)
    finally:
        _finish_timeline(status == "done")
        if watchdog is not None:
            watchdog.stop(status)
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _start_timeline(run: "RunConfig", launch: "LaunchEnv") -> None:
    """--timeline (or $GIGATRON_TIMELINE): every rank records from here (docs/TIMELINE.md)."""
    from gigatron.parallel import timeline

    path = run.logging.timeline or os.environ.get(timeline.ENV)
    if path:
        timeline.start(path, f"rank {launch.rank}")


def _name_timeline_rank(s) -> None:
    """The rank's row title names its place: 'rank 3 (tp 1, pp 0, dp 1)'."""
    from gigatron.parallel import timeline

    if timeline.on:
        g = s.groups
        timeline.name_process(f"rank {g.rank} (tp {g.index('tp')}, pp {g.index('pp')}, "
                              f"dp {g.index('dp')})")


def _context_phrase(p: "ParallelConfig") -> str:
    """' cp=2 (p2p)' under context parallelism, else nothing (dense banners unchanged)."""
    cp = p.context_parallel_size
    return f" cp={cp} ({p.cp_comm_type})" if cp > 1 else ""


def _finish_timeline(collective: bool) -> None:
    """Merge the ranks' spans into the one trace (collective at a normal end; after a
    failure each rank leaves its part and rank 0 merges what it finds)."""
    from gigatron.parallel import timeline

    path = timeline.finish(collective)
    if path is not None:
        print(f"timeline: {os.path.abspath(path)} (open it in ui.perfetto.dev)", flush=True)


def _start_watchdog(launch: "LaunchEnv", timeout_minutes: float) -> Optional["Watchdog"]:
    """Heartbeats through the launcher's store, so a hung rank is named (parallel/watchdog)."""
    from gigatron.parallel.watchdog import start_watchdog

    return start_watchdog(launch.rank, launch.world_size, launch.master_addr,
                          launch.master_port, timeout_minutes * 60)


def _peer_failure(err: RuntimeError, watchdog: Optional["Watchdog"], rank: int,
                  prog: str) -> int:
    """A collective failed: the watchdogs' verdict on a hung rank (it ends this process), or
    the peers that died or failed meanwhile; a data loader worker that died is one line; any
    other error is re-raised."""
    from gigatron.parallel.watchdog import is_peer_failure
    from gigatron.training.run.errors import data_worker_failure

    died = data_worker_failure(err)
    if died is not None:  # one line, not torch's chained tracebacks
        print(f"{prog}: error (rank {rank}): {died}", file=sys.stderr)
        return 1
    if watchdog is None or not is_peer_failure(err):
        raise err
    cause = watchdog.explain_failure(3 * watchdog.interval_s + 1)
    print(f"{prog}: error (rank {rank}): a collective failed ({str(err).splitlines()[0][:200]})"
          f": {cause}", file=sys.stderr)
    return 1
