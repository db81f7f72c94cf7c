"""Where metrics go: a Megatron-style console line, JSON lines, TensorBoard, a progress bar.

One `MetricsLogger` per run, on the rank that reports (global rank 0); the other ranks get a
logger with every sink off. Records are plain dicts with the keys of the JSON lines:

    {"type": "train", "iteration": 10, "consumed_samples": 160, "lm loss": 7.1, "lr": 1e-4,
     "grad norm": 1.3, "loss scale": 1.0, "skipped": 0, "tokens_per_s": ..., ...}
    (an MoE model adds "load_balancing_loss", "z_loss", the worst layer's
     "tokens_per_expert_max_over_mean", "dropped_token_share" and per layer
     "moe": {"layer_0/tokens_per_expert_max_over_mean": 1.2, ...}: training/run/moe.py)
    {"type": "eval", "split": "valid", "iteration": 10, "lm loss": 6.9, "lm loss PPL": ...}
    {"type": "checkpoint", ...}, and one {"type": "summary", ...} at the end (training/observe/summary.py)

Long loops without log lines (evaluation) show progress too: redrawn in place on a terminal,
a line every EVAL_PROGRESS_EVERY_S seconds in logs; it counts batches and reads the clock,
never the device.
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import IO, Callable, Dict, Optional

from gigatron.training.observe import straggler
from gigatron.training.observe.summary import RunTotals, format_summary

# console label, JSON key, format
_CONSOLE_FIELDS = (
    ("consumed samples", "consumed_samples", "{:12d}"),
    ("elapsed time per iteration (ms)", "ms_per_iteration", "{:.1f}"),
    ("throughput per GPU (TFLOP/s/GPU)", "tflops_per_device", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:.0f}"),
    ("MFU", "mfu", "{:.1%}"),
    ("learning rate", "lr", "{:.6E}"),
    ("global batch size", "global_batch_size", "{:5d}"),
    ("lm loss", "lm loss", "{:.6E}"),
    ("load_balancing_loss", "load_balancing_loss", "{:.6E}"),  # MoE, as Megatron logs them
    ("z_loss", "z_loss", "{:.6E}"),
    ("tokens per expert max/mean (worst MoE layer)", "tokens_per_expert_max_over_mean",
     "{:.3f}"),
    ("dropped tokens", "dropped_token_share", "{:.2%}"),
    ("loss scale", "loss scale", "{:.1f}"),
    ("grad norm", "grad norm", "{:.3f}"),
    ("params norm", "params norm", "{:.3f}"),
    ("num zeros", "num zeros", "{:.0f}"),
    ("number of skipped iterations", "skipped", "{:3d}"),
    ("peak memory (MiB)", "peak_memory_mib", "{:.0f}"),
)
_TENSORBOARD_KEYS = ("lm loss", "lr", "grad norm", "params norm", "num zeros", "loss scale",
                     "skipped",
                     "tokens_per_s", "tflops_per_device", "mfu", "peak_memory_mib",
                     "ms_per_iteration", "load_balancing_loss", "z_loss", "tokens_per_expert_max_over_mean",
                     "dropped_token_share")
_MTP_LOSS = re.compile(r"mtp_\d+ loss$")
EVAL_PROGRESS_EVERY_S = 15.0  # seconds between evaluation progress lines in a log


def format_train_line(record: Dict, train_iters: int) -> str:
    """Megatron's per-interval console line for a train record."""
    width = len(str(train_iters))
    parts = [f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration "
             f"{record['iteration']:{width}d}/{train_iters:{width}d}"]
    for label, key, fmt in _CONSOLE_FIELDS:
        value = record.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value) and key != "lm loss"):
            continue
        if key == "tflops_per_device" and value < 0.1:  # a CPU: 0.0 TFLOP/s would say nothing
            label, fmt, value = "throughput per device (GFLOP/s/device)", "{:.2f}", 1e3 * value
        parts.append(f"{label}: {fmt.format(value)}")
        if key == "lm loss":  # multi-token prediction's depths, as Megatron-Core logs them
            parts += [f"{k}: {record[k]:.6E}" for k in sorted(record) if _MTP_LOSS.match(k)]
    timers = record.get("timers_ms")
    if timers:
        parts.append(" ".join(f"{k} {v:.1f}" for k, v in timers.items()) + " (ms)")
    return " | ".join(parts) + " |"


def format_eval_line(record: Dict) -> str:
    """Megatron's validation/test loss block."""
    text = (f" {record['split']} loss at iteration {record['iteration']} | lm loss value: "
            f"{record['lm loss']:.6E} | lm loss PPL: {record['lm loss PPL']:.6E} | ")
    bar = "-" * len(text)
    return f"{bar}\n{text}\n{bar}"


def perplexity(loss: float) -> float:
    return math.exp(min(20.0, loss))


def format_eta(done: int, total: int, seconds: float) -> str:
    """Time left at the rate so far, 'm:ss' ('?' before the first unit is done)."""
    rate = done / max(seconds, 1e-9)
    if rate <= 0:
        return "?"
    eta = (total - done) / rate
    return f"{int(eta // 60):d}:{int(eta % 60):02d}"


class ProgressBar:
    """A one-line progress display (iteration, loss, ETA) redrawn in place on a terminal."""

    def __init__(self, total: int, start_iteration: int = 0, stream: Optional[IO] = None,
                 width: int = 30) -> None:
        self.total, self.first, self.width = total, start_iteration, width
        self.stream = sys.stderr if stream is None else stream
        self.start = time.monotonic()

    def render(self, iteration: int, loss: Optional[float], now: Optional[float] = None) -> str:
        """The progress line for `iteration` of `total` (pure apart from the clock)."""
        now = time.monotonic() if now is None else now
        done = iteration / self.total
        filled = int(round(self.width * done))
        eta_text = format_eta(iteration - self.first, self.total - self.first, now - self.start)
        loss_text = f" loss {loss:.4f}" if loss is not None else ""
        return (f"[{'#' * filled}{'.' * (self.width - filled)}] {iteration}/{self.total} "
                f"({done:.0%}){loss_text} ETA {eta_text}")

    def update(self, iteration: int, loss: Optional[float]) -> None:
        self.stream.write("\r" + self.render(iteration, loss) + "\033[K")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


class LoopProgress:
    """Progress of a counted loop (evaluation batches): redrawn in place on a terminal, or a
    line every `every_s` seconds through `write_line` in a log. Only counts and the clock."""

    def __init__(self, label: str, total: int, write_line: Optional[Callable[[str], None]],
                 bar_stream: Optional[IO] = None, every_s: float = EVAL_PROGRESS_EVERY_S,
                 clock: Callable[[], float] = time.monotonic, unit: str = "batches") -> None:
        self.label, self.total, self.every_s, self.clock = label, total, every_s, clock
        self.write_line, self.bar_stream, self.unit = write_line, bar_stream, unit
        self.start = self.last_line = clock()

    def render(self, done: int, now: float) -> str:
        """'valid evaluation: 3/10 batches (30%), 12 s elapsed, ETA 0:28'."""
        elapsed = now - self.start
        return (f"{self.label}: {done}/{self.total} {self.unit} ({done / self.total:.0%}), "
                f"{elapsed:.0f} s elapsed, ETA {format_eta(done, self.total, elapsed)}")

    def update(self, done: int) -> None:
        """`done` batches of `total` are finished."""
        if self.write_line is None:
            return
        now = self.clock()
        if self.bar_stream is not None:
            self.bar_stream.write("\r" + self.render(done, now) + "\033[K")
            self.bar_stream.flush()
        elif now - self.last_line >= self.every_s and done < self.total:
            self.write_line(self.render(done, now))
            self.last_line = now


class MetricsLogger:
    """Console lines, JSON lines (--metrics-file), TensorBoard (--tensorboard-dir), Weights &
    Biases (--wandb-project: `wandb` holds wandb.init's project, name, dir, config), progress."""

    def __init__(self, enabled: bool, train_iters: int, metrics_file: Optional[str] = None,
                 tensorboard_dir: Optional[str] = None, progress: Optional[bool] = None,
                 append: bool = False, start_iteration: int = 0,
                 stream: Optional[IO] = None, wandb: Optional[Dict] = None) -> None:
        self.enabled, self.train_iters = enabled, train_iters
        self.stream = sys.stdout if stream is None else stream
        self._file = self._tb = self._bar = self._wandb = None
        self.totals = RunTotals(start_iteration)  # what the run summary adds up
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a" if append else "w", encoding="utf-8")
        if tensorboard_dir:
            self._tb = _tensorboard_writer(tensorboard_dir)
        if wandb:
            self._wandb = _wandb_run(wandb)
        if progress is None:
            progress = sys.stderr.isatty()
        if progress:
            self._bar = ProgressBar(train_iters, start_iteration)

    def truncate_after(self, iteration: int) -> None:
        """On resume: drop records of iterations after the checkpoint (a run that went on
        past its last save and crashed logged them), so the file reads as one run."""
        if self._file is None:
            return
        self._file.close()
        path = self._file.name
        with open(path, encoding="utf-8") as f:
            kept = [line for line in f if line.strip() and
                    json.loads(line).get("iteration", 0) <= iteration]
        self._file = open(path, "w", encoding="utf-8")
        self._file.writelines(kept)
        self._file.flush()

    def print(self, text: str) -> None:
        if self.enabled:
            if self._bar is not None:
                self.stream.write("\r\033[K")
            print(text, file=self.stream, flush=True)

    def train(self, record: Dict) -> None:
        """One logged interval: console line, JSON line, TensorBoard scalars."""
        if not self.enabled:
            return
        self.print(format_train_line(record, self.train_iters))
        if record.get("straggler"):
            self.print(straggler.format_line(record["straggler"]))
        self._write({"type": "train", **record})
        self.totals.add_train(record)
        if self._tb is not None:
            scalars = {key: record.get(key) for key in _TENSORBOARD_KEYS}
            scalars.update({key: record[key] for key in record if _MTP_LOSS.match(key)})
            scalars.update({f"timers_ms/{name}": ms
                            for name, ms in (record.get("timers_ms") or {}).items()})
            scalars.update({f"optimizer/{name}": value
                            for name, value in (record.get("optimizer") or {}).items()})
            scalars.update({f"moe/{name}": value  # per MoE layer
                            for name, value in (record.get("moe") or {}).items()})
            for key, value in scalars.items():
                if value is not None:
                    self._tb.add_scalar(key, value, record["iteration"])
        if self._wandb is not None:
            self._wandb.log({key: record[key] for key in _TENSORBOARD_KEYS
                             if record.get(key) is not None}, step=record["iteration"])

    def evaluation(self, record: Dict) -> None:
        """A valid/test loss: console block, JSON line, TensorBoard scalar."""
        if not self.enabled:
            return
        record = {**record, "lm loss PPL": perplexity(record["lm loss"])}
        self.print(format_eval_line(record))
        self._write({"type": "eval", **record})
        self.totals.add_eval(record)
        if self._tb is not None:
            self._tb.add_scalar(f"{record['split']} lm loss", record["lm loss"],
                                record["iteration"])
        if self._wandb is not None:
            self._wandb.log({f"{record['split']} lm loss": record["lm loss"]},
                            step=record["iteration"])

    def progress(self, iteration: int, loss: Optional[float]) -> None:
        if self.enabled and self._bar is not None:
            self._bar.update(iteration, loss)

    def loop_progress(self, label: str, total: int) -> LoopProgress:
        """A progress display for `total` units of a loop (a no-op on non-reporting ranks)."""
        bar = self._bar.stream if self._bar is not None else None
        return LoopProgress(label, total, self.print if self.enabled else None, bar,
                            every_s=EVAL_PROGRESS_EVERY_S)

    def summary(self, record: Dict) -> None:
        """The end-of-run block on the console and one summary JSON line."""
        if self.enabled:
            self.print(format_summary(record))
            self._write({"type": "summary", **record})

    def event(self, record: Dict) -> None:
        """Any other JSON line (checkpoint saved, run summary)."""
        if self.enabled:
            self._write(record)

    def _write(self, record: Dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        self._file = self._tb = self._bar = self._wandb = None


def _tensorboard_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ValueError("--tensorboard-dir needs the tensorboard package: "
                         "pip install tensorboard (or pip install -e '.[monitor]')") from None
    return SummaryWriter(log_dir=log_dir)


def _wandb_run(options: Dict):
    """wandb.init(**options) (the package is checked with the flags, before any rank starts)."""
    import wandb

    if options.get("dir"):
        os.makedirs(options["dir"], exist_ok=True)
    return wandb.init(**options)
