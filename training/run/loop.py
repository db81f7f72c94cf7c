"""The training loop: steps through the pipeline schedule, evaluation, logging, checkpoints.

One iteration reads as the data flows:

    lr from the schedule's position -> zero grads -> executor runs the schedule (forward,
    backward, p2p; reductions start as backward produces grads) -> grad sync finishes ->
    optimizer step (ZeRO: norm, clip, update) -> the step's loss joins the interval's

No step between two log lines waits for the host: losses and the grad norm stay device
tensors, the interval's losses are reduced by ONE all-reduce at --log-interval, and the
exit signal (SIGTERM) is checked there too, folded into the peak-memory all-reduce, so every
rank sees it at the same iteration (SIGTERM is therefore acted on at the next multiple of
--log-interval). The one exception is fp16: its overflow flag decides the skip and the
loss-scale update on the host, one read per step (see ZeroOptimizer.step). A skipped step
(fp16 overflow) still consumes its samples but does not advance the lr schedule (Megatron's
rule); the lr schedule stays exact without any extra read because bf16/fp32 never skip and
fp16 already knows its skip on the host.
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from gigatron.parallel import comm, timeline
from gigatron.parallel.activity import activity
from gigatron.parallel.launcher.progress import inject_fault, note_progress
from gigatron.parallel.pipeline.interfaces import GradSync
from gigatron.parallel.topology import ProcessGroups
from gigatron.parallel.zero import ZeroOptimizer
from gigatron.parallel.zero.state_stats import optimizer_state_stats
from gigatron.training.checkpoint import orchestrator as checkpoint_state
from gigatron.training.run.batch_rampup import run_rampup
from gigatron.training.run.builders import Pipeline, micro_batches
from gigatron.training.run.compile import CompileTimeNote
from gigatron.training.config.run_config import RunConfig, TrainConfig
from gigatron.training.run.decoupled_lr import set_decoupled_lr
from gigatron.training.checkpoint.torch_dist.async_save import SavedCheckpoint
from gigatron.training.run.moe import MoETraining, moe_training
from gigatron.training.run.mtp import MTPTraining, mtp_training
from gigatron.training.run.nan_check import NonFiniteWatch
from gigatron.training.run.per_token_loss import EvalLoss, loss_divisor, per_token_loss, step_loss
from gigatron.training.observe.profiling import Profiler
from gigatron.training.observe.logger import MetricsLogger
from gigatron.training.lr.megatron import learning_rate
from gigatron.training.observe.flops import peak_memory_bytes, throughput
from gigatron.training.checkpoint.orchestrator import TrainProgress
from gigatron.training.observe import straggler
from gigatron.training.observe.timers import Timers


@dataclass
class Session:
    """Everything the loop works with, built once by `pretrain._build_session`."""

    run: RunConfig
    groups: ProcessGroups
    device: torch.device
    chunks: List[torch.nn.Module]
    zero: ZeroOptimizer
    grad_sync: GradSync  # the executor's hook: `zero`, or `zero` with its wait timed
    pipeline: Pipeline
    datasets: Sequence[Optional[object]]  # train, valid, test
    logger: MetricsLogger
    timers: Timers
    flops_per_token: float
    peak_tflops: Optional[float]
    saved_iterations: List[int] = field(default_factory=list)
    nonfinite: Optional[NonFiniteWatch] = None  # --check-for-nan-in-loss-and-grad, set by train
    started: float = field(default_factory=time.monotonic)  # --exit-duration-in-mins counts
    # from here (the program's start, as Megatron's)
    start_samples: int = 0  # samples consumed when this run started (a resume's are earlier)
    checkpointer: checkpoint_state.Checkpointer = field(
        default_factory=checkpoint_state.Checkpointer)  # --async-save keeps a save pending
    # gigatron plan's predicted peak bytes per pipeline stage: on CUDA the first log line is
    # followed by the measured peak beside it (then None)
    memory_plan: Optional[Dict[int, float]] = None
    moe: Optional[MoETraining] = None  # an MoE model's step hook and log fields, set by train
    mtp: Optional[MTPTraining] = None  # multi-token prediction's log fields, set by train
    compile_note: Optional[CompileTimeNote] = None  # --torch-compile's compile time, once


@dataclass
class StepOutcome:
    """One step's results; tensors stay on the device until the next log line reads them."""

    loss: Optional[torch.Tensor]  # mean over this rank's micro-batches; last stage only
    lr: float
    grad_norm: Optional[torch.Tensor]
    loss_scale: float
    skipped: bool
    num_zeros: Optional[torch.Tensor] = None  # --log-num-zeros-in-grad


class ExitSignal:
    """SIGTERM sets a flag; the loop reduces it over ranks at log intervals."""

    def __init__(self, enabled: bool) -> None:
        self.enabled, self.received = enabled, False
        if enabled:
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.received = True


def _as_values(s: Session, values: Sequence[float]) -> torch.Tensor:
    """Host numbers as one tensor on the session's device (NCCL takes no CPU tensors)."""
    dtype = torch.float64 if s.device.type == "cpu" else torch.float32
    return torch.tensor(list(values), dtype=dtype, device=s.device)


def mean_loss_over_ranks(s: Session, local_sum: Optional[torch.Tensor], steps: int) -> float:
    """Mean of `steps` step losses (summed in `local_sum` on the last pipeline stage) over
    data-parallel replicas, known on every rank: one all-reduce and one host read."""
    contributes = s.pipeline.needs_labels and local_sum is not None
    terms = _as_values(s, [0.0, float(contributes)])
    if contributes:
        terms[0] = local_sum.detach().to(terms.dtype)
    comm.all_reduce(terms)  # last-stage ranks (each tp rank holds the same loss) contribute
    total, ranks = terms.tolist()
    return total / (ranks * steps) if ranks else float("nan")


def max_over_ranks(s: Session, values: Sequence[float]) -> List[float]:
    """Element-wise max of host numbers over all ranks (peak memory, exit flag)."""
    terms = _as_values(s, values)
    comm.all_reduce(terms, op=comm.ReduceOp.MAX)
    return terms.tolist()


def cp_rank(s: Session) -> int:
    """This rank's index in its context-parallel group (0 without context parallelism)."""
    return s.groups.index("cp") if s.groups.cp_group is not None else 0


def _next_batches(it: Iterator[dict], n: int, timers: Optional[Timers] = None) -> List[dict]:
    if timers is not None:
        timers.start("data")
    start = timeline.now() if timeline.on else 0
    batches = [next(it) for _ in range(n)]
    if timeline.on:
        timeline.record("data", start)
    if timers is not None:
        timers.stop("data")
    return batches


def train_step(s: Session, batches: List[dict], progress: TrainProgress) -> StepOutcome:
    """One optimizer step over the global batch (this rank's micro-batches: their count is
    the step's, which a batch ramp-up grows)."""
    lr = learning_rate(progress.lr_steps, s.run.lr_schedule)
    s.zero.set_lr(lr)
    set_decoupled_lr(s.zero.optimizer, progress.lr_steps, s.run.lr_schedule,
                     s.run.settings.decoupled_lr)
    s.zero.zero_grad()
    divisor = loss_divisor(s.pipeline.needs_labels and per_token_loss(s.run), batches,
                           s.groups["dp-cp"])  # --calculate-per-token-loss: global tokens
    losses = s.pipeline.executor.run(s.pipeline.train_schedule_for(len(batches)), batches,
                                     loss_scale=s.zero.loss_scale, loss_divisor=divisor)
    s.grad_sync.finish_sync()
    s.timers.start("optimizer")
    with timeline.span("optimizer step"):
        step = s.zero.step()
    s.timers.stop("optimizer")
    if s.moe is not None:
        s.moe.after_step(s.pipeline.executor.aux_losses, len(batches))
    if s.mtp is not None:
        s.mtp.after_step(s.pipeline.executor.aux_losses, len(batches))
    return StepOutcome(step_loss(losses, divisor, batches, s.groups["dp-cp"]), lr,
                       step.grad_norm, step.loss_scale, step.skipped, step.num_zeros)


def advance(progress: TrainProgress, outcome: StepOutcome, global_batch_size: int) -> None:
    """Count the step's `global_batch_size` samples: always as consumed, in the lr schedule
    only if the step was applied."""
    progress.iteration += 1
    progress.consumed_train_samples += global_batch_size
    if outcome.skipped:
        progress.skipped_iterations += 1
    else:
        progress.lr_steps += global_batch_size


def evaluate(s: Session, split: int, consumed: int, iterations: int,
             label: str = "evaluation") -> Optional[float]:
    """Mean lm loss over `iterations` global batches of split 0/1/2 from sample `consumed`;
    shows progress under `label` (batches and the clock; the losses stay on the device)."""
    dataset = s.datasets[split]
    if dataset is None or iterations == 0:
        return None
    it = micro_batches(s.run, dataset, consumed, s.groups.index("dp"), s.device, s.pipeline,
                       cp_rank(s))
    if s.zero is not None:  # (`gigatron evaluate` builds no optimizer)
        s.zero.finish_param_sync()  # --overlap-param-gather: the step's gathers, all waited
    for chunk in s.chunks:
        chunk.eval()
    terms = EvalLoss(s.pipeline.needs_labels and per_token_loss(s.run), s.groups["dp-cp"])
    timed = dict(s.timers.elapsed)  # eval forwards are not the step's
    shown = s.logger.loop_progress(label, iterations)
    try:
        with torch.no_grad(), timeline.span(label):
            for done in range(1, iterations + 1):
                batches = _next_batches(it, s.run.train.num_microbatches)
                terms.add(s.pipeline.executor.run(s.pipeline.eval_schedule, batches), batches)
                shown.update(done)
    finally:
        for chunk in s.chunks:
            chunk.train()
        s.timers.elapsed.clear()
        s.timers.elapsed.update(timed)
    return mean_loss_over_ranks(s, *terms.result())


class _Interval:
    """What accumulates between two log lines (the loss sum on the device)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.loss_sum: Optional[torch.Tensor] = None
        self.steps = 0
        self.skipped = 0
        self.samples = 0
        self.batch_size = 0  # the last step's global batch

    def add(self, outcome: StepOutcome, batch_size: int) -> None:
        if outcome.loss is not None:
            self.loss_sum = (outcome.loss if self.loss_sum is None
                             else self.loss_sum + outcome.loss)
        self.steps += 1
        self.skipped += int(outcome.skipped)
        self.samples += batch_size
        self.batch_size = batch_size


def _log(s: Session, progress: TrainProgress, outcome: StepOutcome, interval: _Interval,
         exit_signal: ExitSignal) -> bool:
    """Reduce and write the interval's record; returns whether any rank got SIGTERM."""
    elapsed = time.perf_counter() - interval.start
    if s.nonfinite is not None:
        s.nonfinite.check(s.saved_iterations)
    n = interval.steps
    loss = mean_loss_over_ranks(s, interval.loss_sum, n)
    memory, stop = max_over_ranks(s, [peak_memory_bytes(s.device), float(exit_signal.received)])
    tokens = interval.samples * s.run.model.seq_length
    rates = throughput(tokens, elapsed, s.flops_per_token, s.run.parallel.world_size,
                       s.peak_tflops)
    phases = s.timers.reset()
    accounted = sum(phases.values())
    grad_norm = None if outcome.grad_norm is None else float(outcome.grad_norm)
    record = {
        "iteration": progress.iteration, "consumed_samples": progress.consumed_train_samples,
        "lm loss": loss, "lr": outcome.lr, "grad norm": grad_norm,
        "loss scale": outcome.loss_scale, "skipped": interval.skipped,
        "global_batch_size": interval.batch_size, "samples": interval.samples,
        "ms_per_iteration": 1000 * elapsed / n,
        **rates, "peak_memory_mib": memory / 2 ** 20,
        "timers_ms": {name: 1000 * sec / n for name, sec in sorted(phases.items())},
    }
    if outcome.num_zeros is not None:
        record["num zeros"] = float(outcome.num_zeros)
    if s.moe is not None:  # collective: every rank
        record.update(s.moe.log_fields())
    if s.mtp is not None:  # collective: every rank
        record.update(s.mtp.log_fields())
    logging = s.run.logging
    if logging.log_optimizer_states_to_tensorboard or logging.log_params_norm:
        stats = optimizer_state_stats(s.zero)  # collective: every rank
        if logging.log_optimizer_states_to_tensorboard:
            record["optimizer"] = stats
        if logging.log_params_norm:
            record["params norm"] = stats["weight_l2"]
    if "forward" in phases:  # backward is what the measured phases leave of the step
        record["timers_ms"]["backward"] = max(0.0, 1000 * (elapsed - accounted) / n)
    if s.run.logging.log_straggler and not s.run.logging.disable_straggler_on_startup:
        record["straggler"] = straggler.fields_over_ranks(  # collective: every rank
            elapsed, phases.get("comm", 0.0), n, s.run.logging.straggler_minmax_count, s.device)
    s.logger.train(record)
    note_progress(logged=progress.iteration)  # for `gigatron launch --max_restarts`
    if s.memory_plan is not None and s.device.type == "cuda":
        _report_planned_memory(s)
    s.logger.progress(progress.iteration, loss)
    return exit_signal.enabled and stop > 0


def _report_planned_memory(s: Session) -> None:
    """Collective, once: each pipeline stage's measured peak (the max over its ranks) beside
    the plan's prediction."""
    from gigatron.training.plan.report import measured_lines

    assert s.memory_plan is not None
    world, rank = comm.group_size(), comm.group_rank()
    peaks = torch.zeros(2, world, dtype=torch.float64, device=s.device)
    peaks[0, rank], peaks[1, rank] = float(peak_memory_bytes(s.device)), s.groups.index("pp")
    comm.all_reduce(peaks)
    measured: Dict[int, float] = {}
    for peak, stage in zip(*peaks.tolist()):
        measured[int(stage)] = max(measured.get(int(stage), 0.0), peak)
    for line in measured_lines(s.memory_plan, measured):
        s.logger.print(line)
    s.memory_plan = None


def _save(s: Session, progress: TrainProgress, persistent: bool = True) -> None:
    """Check for a non-finite step first (never checkpoint after one), then save if asked
    (with --async-save the save goes on in the background; the previous one is waited for);
    a non-persistent one (--non-persistent-save-interval) is not counted as saved."""
    if s.nonfinite is not None:
        s.nonfinite.check(s.saved_iterations)
    if s.run.checkpoint.save is None or progress.iteration in s.saved_iterations:
        return
    activity.at(progress.iteration, "saving checkpoint")
    s.zero.finish_param_sync()  # --overlap-param-gather: save the gathered parameters
    with timeline.span("checkpoint save"):
        finished = s.checkpointer.save(s.run, s.groups, progress, s.chunks, s.zero, s.device,
                                       persistent)
    if persistent:
        s.saved_iterations.append(progress.iteration)
    for saved in finished:
        _log_saved(s, saved)


def _wait_for_saves(s: Session) -> None:
    """The end of training waits for a background save (and logs it)."""
    saved = s.checkpointer.wait()
    if saved is not None:
        _log_saved(s, saved)


def _log_saved(s: Session, saved: SavedCheckpoint) -> None:
    how = " in the background" if saved.background else ""
    s.logger.print(f"saved checkpoint at iteration {saved.iteration:7d} to {saved.folder} "
                   f"({saved.seconds:.1f} s{how})")
    s.logger.event({"type": "checkpoint", "iteration": saved.iteration, "path": saved.folder,
                    "seconds": saved.seconds})
    note_progress(saved=saved.iteration)


def logged_validation_start(progress: TrainProgress, train: TrainConfig) -> int:
    """First valid sample of the validation logged at `progress.iteration` (a checkpoint's
    progress: saved after it), or of the next one if none ran there: `gigatron evaluate`'s."""
    assert train.global_batch_size is not None  # resolved
    per_validation = train.eval_iters * train.global_batch_size
    ran_here = train.eval_iters > 0 and progress.iteration % train.eval_interval == 0
    if ran_here and progress.consumed_valid_samples >= per_validation:
        return progress.consumed_valid_samples - per_validation
    return progress.consumed_valid_samples


def _evaluate_and_log(s: Session, progress: TrainProgress, split: int, name: str) -> None:
    t = s.run.train
    consumed = progress.consumed_valid_samples if split == 1 else 0
    loss = evaluate(s, split, consumed, t.eval_iters, f"{name} evaluation")
    if loss is None:
        return
    if split == 1:
        progress.consumed_valid_samples += t.eval_iters * t.global_batch_size
    s.logger.evaluation({"split": name, "iteration": progress.iteration, "lm loss": loss})


def _exit_reason(s: Session, progress: TrainProgress, sigterm: bool) -> Optional[str]:
    """Why the loop stops after this iteration (None: it goes on); every rank agrees."""
    t = s.run.train
    if sigterm:
        return f"exiting on SIGTERM at iteration {progress.iteration}"
    if t.exit_duration_in_mins:  # Megatron's check: every iteration, the ranks' max time
        (minutes,) = max_over_ranks(s, [(time.monotonic() - s.started) / 60])
        if minutes > t.exit_duration_in_mins:
            return (f"exiting after {minutes:.1f} minutes at iteration {progress.iteration} "
                    f"(--exit-duration-in-mins {t.exit_duration_in_mins:g})")
    if t.exit_interval and progress.iteration % t.exit_interval == 0:
        return f"exiting at iteration {progress.iteration} (--exit-interval)"
    return None


def _start_nonfinite_watch(s: Session, progress: TrainProgress) -> None:
    if s.run.train.check_for_nan_in_loss_and_grad:
        # fp16 overflow steps have inf grads by design (skipped, scale backed off): loss only
        s.nonfinite = NonFiniteWatch(s.device, s.groups.rank, s.run.parallel.world_size,
                                     check_grad_norm=s.zero.param_dtype != torch.float16,
                                     loaded_iteration=progress.iteration,
                                     save_dir=s.run.checkpoint.save)


def train(s: Session, progress: TrainProgress) -> TrainProgress:
    """Train from `progress` to --train-iters (or an exit condition); returns the progress.
    Each step's global batch comes from the batch ramp (constant without one); when the ramp
    changes the micro-batch count, a checkpoint is saved first (as Megatron does)."""
    t, ck = s.run.train, s.run.checkpoint
    it = micro_batches(s.run, s.datasets[0], progress.consumed_train_samples,
                       s.groups.index("dp"), s.device, s.pipeline, cp_rank(s))
    exit_signal = ExitSignal(t.exit_signal_handler)
    _start_nonfinite_watch(s, progress)
    s.moe = moe_training(s.chunks, s.run.model, s.groups.dp, s.groups.size("tp-cp") *
                         s.run.parallel.dp, s.device)
    s.mtp = mtp_training(s.run.model.mtp_num_layers, s.pipeline.needs_labels, s.device)
    ramp = run_rampup(t, s.run.parallel.dp)
    interval, last_count = _Interval(), None
    profiler = Profiler(s.run.settings.profiling, s.run.logging.tensorboard_dir, s.groups.rank,
                        s.run.parallel.world_size, s.device.type,
                        s.run.logging.log_interval)  # --profile, --record-memory-history
    while progress.iteration < t.train_iters:
        batch_size = ramp.batch_size(progress.consumed_train_samples)
        count = batch_size // ramp.micro_batch_times_dp
        if last_count is not None and count != last_count:
            _save(s, progress)
        last_count = count
        profiler.before_step(progress.iteration)
        activity.at(progress.iteration + 1, "train step")  # for hang reports (watchdog)
        inject_fault(progress.iteration + 1)  # GIGATRON_KILL_RANK_AT (restart tests)
        started = timeline.now() if timeline.on else 0
        outcome = train_step(s, _next_batches(it, count, s.timers), progress)
        advance(progress, outcome, batch_size)
        if s.compile_note is not None and (line := s.compile_note.after_step()):
            s.logger.print(line)
        profiler.after_step(progress.iteration)
        if timeline.on:
            timeline.record(f"iteration {progress.iteration}", started)
        if s.nonfinite is not None:
            s.nonfinite.observe(progress.iteration, outcome.loss, outcome.grad_norm)
            s.nonfinite.count_skip(progress.iteration, outcome.skipped, s.zero.scaler,
                                   s.saved_iterations)
        interval.add(outcome, batch_size)
        sigterm = False
        if progress.iteration % s.run.logging.log_interval == 0:
            sigterm = _log(s, progress, outcome, interval, exit_signal)
            interval = _Interval()
            timeline.flush()  # a crashed run keeps its spans up to here
        paused = time.perf_counter()  # eval and saving are not the interval's step time
        if t.eval_iters and progress.iteration % t.eval_interval == 0:
            activity.at(progress.iteration, "validation")
            _evaluate_and_log(s, progress, 1, "valid")
        if ck.save_interval and progress.iteration % ck.save_interval == 0:
            _save(s, progress)
        elif ck.non_persistent_save_interval and \
                progress.iteration % ck.non_persistent_save_interval == 0:
            _save(s, progress, persistent=False)
        interval.start += time.perf_counter() - paused
        reason = _exit_reason(s, progress, sigterm)
        if reason is not None:
            s.logger.print(reason)
            _save(s, progress)
            _wait_for_saves(s)
            return progress
    _save(s, progress)
    _wait_for_saves(s)
    if not t.skip_test:
        activity.at(progress.iteration, "test evaluation")
        _evaluate_and_log(s, progress, 2, "test")
    return progress
