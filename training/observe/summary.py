"""The end-of-run summary: what a person wants to know when a run finishes, in one block.

`RunTotals` adds up the records the logger writes (so the summary agrees with the metrics
file); `format_summary` turns the summary record into lines. The record itself goes into the
metrics file as `{"type": "summary", ...}`, one per run:

    {"type": "summary", "iteration": 120, "wall_seconds": 151.2, "tokens_this_run": 491520,
     "tokens_total": 491520, "tokens_per_s": 4467.0, "tflops_per_device": 0.00085,
     "mfu": null, "peak_memory_mib": 412.0, "final_valid_loss": 4.12,
     "final_valid_iteration": 120, "best_valid_loss": 4.10, "best_valid_iteration": 100, ...}

Throughput counts the logged training steps only (evaluation and checkpoint saves are not
in the step time), as the per-interval lines do.
"""
from __future__ import annotations

import importlib.util
from typing import Dict, List, Optional, Tuple


class RunTotals:
    """Sums over this run's train records and keeps its eval losses, for the summary."""

    def __init__(self, start_iteration: int = 0) -> None:
        self.start_iteration = start_iteration
        self.last_iteration = start_iteration
        self.train_steps = 0  # steps inside logged intervals
        self.train_seconds = 0.0  # their step time (evaluation and saving excluded)
        self.train_samples = 0  # their samples (a batch ramp-up changes the step's)
        self.evals: Dict[str, List[Tuple[int, float]]] = {}

    def add_train(self, record: Dict) -> None:
        """One logged interval: its steps and their time (ms/iteration x steps)."""
        steps = record["iteration"] - self.last_iteration
        self.last_iteration = record["iteration"]
        if steps > 0 and record.get("ms_per_iteration") is not None:
            self.train_steps += steps
            self.train_seconds += steps * record["ms_per_iteration"] / 1000
            self.train_samples += record.get("samples",
                                             steps * record.get("global_batch_size", 0))

    def add_eval(self, record: Dict) -> None:
        self.evals.setdefault(record["split"], []).append((record["iteration"],
                                                           record["lm loss"]))

    def loss_fields(self, split: str = "valid") -> Dict[str, Optional[float]]:
        """final_/best_<split>_loss and _iteration (None without an evaluation)."""
        results = [(it, loss) for it, loss in self.evals.get(split, []) if loss == loss]
        if not results:  # none, or only NaN losses
            return {f"{which}_{split}_{key}": None for which in ("final", "best")
                    for key in ("loss", "iteration")}
        final, best = results[-1], min(results, key=lambda r: r[1])
        return {f"final_{split}_loss": final[1], f"final_{split}_iteration": final[0],
                f"best_{split}_loss": best[1], f"best_{split}_iteration": best[0]}


def format_duration(seconds: float) -> str:
    """'45.2 s', '2 min 31 s', '3 h 05 min': a wall time at a glance."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60):02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def format_flops(tflops_per_device: float) -> str:
    """TFLOP/s per device, or GFLOP/s where TFLOP/s would round to 0 (a CPU)."""
    if tflops_per_device < 0.1:
        return f"{1e3 * tflops_per_device:.2f} GFLOP/s per device"
    return f"{tflops_per_device:.1f} TFLOP/s per device"


def _loss_line(record: Dict, split: str, label: str) -> Optional[str]:
    final = record.get(f"final_{split}_loss")
    if final is None:
        return None
    line = f"{label} loss: final {final:.4f} (iteration {record[f'final_{split}_iteration']})"
    if record.get(f"best_{split}_iteration") != record.get(f"final_{split}_iteration"):
        line += (f", best {record[f'best_{split}_loss']:.4f} "
                 f"(iteration {record[f'best_{split}_iteration']})")
    return line


def _throughput_line(record: Dict) -> str:
    if not record.get("train_seconds"):
        return "throughput: no logged training interval (fewer iterations than --log-interval)"
    mfu = record.get("mfu")
    return (f"throughput: {record['tokens_per_s']:,.0f} tokens/s, "
            f"{format_flops(record['tflops_per_device'])}"
            f"{f', MFU {mfu:.1%}' if mfu is not None else ''} "
            f"(over {record['train_steps']} logged steps, "
            f"{format_duration(record['train_seconds'])}; evaluation and saving excluded)")


def format_summary(record: Dict) -> str:
    """The summary block printed at the end of a run (from the summary record)."""
    lines = [f"done: iteration {record['iteration']}, {record['consumed_samples']} samples, "
             f"{record['skipped_iterations']} skipped steps, "
             f"wall time {format_duration(record['wall_seconds'])}",
             f"tokens trained: {record['tokens_this_run']:,} this run, "
             f"{record['tokens_total']:,} in total",
             _loss_line(record, "valid", "validation"), _loss_line(record, "test", "test"),
             _throughput_line(record),
             f"peak memory: {record['peak_memory_mib']:,.0f} MiB (the largest rank's)"]
    for key, label in (("checkpoint", "checkpoint"), ("metrics_file", "metrics"),
                       ("tensorboard_dir", "tensorboard")):
        if record.get(key):
            lines.append(f"{label}: {record[key]}")
    if record.get("metrics_file"):
        hint = "" if importlib.util.find_spec("matplotlib") else \
            "  (needs matplotlib: pip install 'gigatron[plot]')"
        lines.append(f"plots: gigatron plot {record['metrics_file']}{hint}")
    return "\n".join(line for line in lines if line is not None)
