"""Megatron's --profile family: which training steps to profile, on which ranks, and how.

As in Megatron-LM's `train` (at the Llama-3 8B FP8 script's commit):

- `--profile --use-pytorch-profiler`: a torch.profiler run on each profiled rank, started
  before the first step with the schedule wait = start - 1, warm-up = 1 (0 when start is 0),
  active = end - start, repeat = 1, stepped at the top of every iteration: the trace holds
  the iterations start .. end - 1 of this run (1-based; ProfilerStep#start ..
  ProfilerStep#end-1 in it) and is written, when the active steps end, with
  export_chrome_trace to `<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz`
  (`./torch_profile/` without --tensorboard-dir). --pytorch-profiler-collect-shapes and
  --pytorch-profiler-collect-callstack add shapes and Python stacks.
- `--profile` alone: a cudaProfilerStart/Stop range for `nsys --capture-range=cudaProfilerApi`
  from the top of the iteration after --profile-step-start iterations to the end of iteration
  --profile-step-end. That needs CUDA: on a CPU the banner says it cannot happen (and points
  to --use-pytorch-profiler); nothing else changes.
- `--profile-ranks`: the global ranks that profile; empty (the default) is every rank.
- `--record-memory-history`: the CUDA caching allocator records its events from the start of
  training and the last rank writes the snapshot to --memory-snapshot-path at every log
  interval and after the first iteration. CUDA only: on a CPU the banner says nothing is
  recorded.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    import torch

    from gigatron.training.config.validation import Problems


@dataclass(frozen=True)
class ProfilingSettings:
    """Megatron's profiling flags (docs/FLAGS.md; the steps count this run's iterations)."""

    profile: bool = setting(
        False, "profile the steps --profile-step-start..--profile-step-end: with "
        "--use-pytorch-profiler a torch.profiler trace, else an nsys (cudaProfilerApi) range, "
        "which needs CUDA (on a CPU the banner says so)", "--profile")
    profile_step_start: int = setting(10, "the step profiling starts at",
                                      "--profile-step-start")
    profile_step_end: int = setting(12, "the step profiling stops at", "--profile-step-end")
    use_pytorch_profiler: bool = setting(
        False, "with --profile: torch.profiler, trace written to <--tensorboard-dir>/../"
        "torch_profile/rank-<rank>.json.gz", "--use-pytorch-profiler")
    pytorch_profiler_collect_shapes: bool = setting(
        False, "the torch.profiler trace records tensor shapes",
        "--pytorch-profiler-collect-shapes")
    pytorch_profiler_collect_callstack: bool = setting(
        False, "the torch.profiler trace records Python call stacks",
        "--pytorch-profiler-collect-callstack")
    profile_ranks: Optional[List[int]] = setting(
        None, "global ranks that profile (not given or empty: every rank, Megatron's [])",
        "--profile-ranks", metavar="RANK")
    record_memory_history: bool = setting(
        False, "record the CUDA allocator's history; the last rank writes the snapshot to "
        "--memory-snapshot-path at each log interval (CUDA only: on a CPU the banner says "
        "nothing is recorded)", "--record-memory-history")
    memory_snapshot_path: str = setting("snapshot.pickle",
                                        "where --record-memory-history writes its snapshot",
                                        "--memory-snapshot-path")


def check_profiling(s: ProfilingSettings, p: "Problems") -> None:
    """Step bounds Megatron's schedule cannot run."""
    if s.profile and s.profile_step_start < 0:
        p.add(f"--profile-step-start must be >= 0, got {s.profile_step_start}")
    if s.profile and s.profile_step_end <= s.profile_step_start:
        p.add(f"--profile-step-end {s.profile_step_end} must be after --profile-step-start "
              f"{s.profile_step_start}: nothing would be profiled")


def profiling_notes(s: ProfilingSettings, device_type: str) -> List[str]:
    """The banner's lines for what cannot happen on this device."""
    notes = []
    if s.profile and not s.use_pytorch_profiler and device_type != "cuda":
        notes.append("--profile without --use-pytorch-profiler opens an nsys (cudaProfilerApi) "
                     "range, which needs CUDA: nothing is profiled on this "
                     f"{device_type}; add --use-pytorch-profiler for a torch.profiler trace")
    if s.record_memory_history and device_type != "cuda":
        notes.append(f"--record-memory-history records the CUDA allocator: nothing is recorded "
                     f"on this {device_type}")
    return notes


def trace_path(tensorboard_dir: Optional[str], rank: int) -> str:
    """Where Megatron writes a rank's torch.profiler trace."""
    folder = os.path.join(tensorboard_dir, os.pardir) if tensorboard_dir else os.curdir
    return os.path.normpath(os.path.join(folder, "torch_profile", f"rank-{rank}.json.gz"))


class Profiler:
    """One rank's profiling over the training loop: `before_step(iteration)` at the top of
    each iteration, `after_step(iteration)` once it is done (iteration: completed steps)."""

    def __init__(self, settings: ProfilingSettings, tensorboard_dir: Optional[str], rank: int,
                 world_size: int, device_type: str, log_interval: int) -> None:
        import torch

        s = settings
        self.snapshot_path, self.rank, self.last_rank = s.memory_snapshot_path, rank, \
            rank == world_size - 1
        self.cuda, self.log_interval = device_type == "cuda", log_interval
        ranks = s.profile_ranks or []
        self.on = s.profile and (not ranks or rank in ranks)
        self.start, self.end = s.profile_step_start, s.profile_step_end
        self.torch_profiler: Optional[torch.profiler.profile] = None
        self.path = trace_path(tensorboard_dir, rank)
        if self.on and s.use_pytorch_profiler:
            self.torch_profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(self.start - 1, 0),
                                                 warmup=1 if self.start > 0 else 0,
                                                 active=self.end - self.start, repeat=1),
                on_trace_ready=self._write_trace,
                record_shapes=s.pytorch_profiler_collect_shapes,
                with_stack=s.pytorch_profiler_collect_callstack)
            self.torch_profiler.start()
        self.memory = self.cuda and s.record_memory_history and (not ranks or rank in ranks)
        if self.memory:
            from gigatron.training.observe.cuda_profiler import record_memory_history
            record_memory_history()

    def _write_trace(self, prof: "torch.profiler.profile") -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)

    def before_step(self, iteration: int) -> None:
        if not self.on:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iteration == self.start and self.cuda:
            from gigatron.training.observe.cuda_profiler import nsys_range_start
            nsys_range_start()

    def after_step(self, iteration: int) -> None:
        if self.memory and self.last_rank and (iteration % self.log_interval == 0 or
                                               iteration == 1):
            from gigatron.training.observe.cuda_profiler import dump_memory_snapshot
            dump_memory_snapshot(self.snapshot_path or "snapshot.pickle")
        if not self.on or iteration != self.end:
            return
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        elif self.cuda:
            from gigatron.training.observe.cuda_profiler import nsys_range_stop
            nsys_range_stop()
