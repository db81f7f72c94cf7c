"""Draw a run's metrics file as PNG charts: loss, learning rate, grad norm, throughput."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron plot runs/x/metrics.jsonl [--output-dir DIR]`; needs matplotlib."""
    parser = argparse.ArgumentParser(
        description="Draw a --metrics-file (JSON lines) as PNG charts: loss (train, "
                    "validation, test), learning rate, grad norm, throughput.",
        allow_abbrev=False)
    parser.add_argument("metrics_file", help="the JSON-lines file a run wrote (--metrics-file)")
    parser.add_argument("--output-dir", default=None,
                        help="folder for the PNGs (default: a folder <name>_plots next to "
                             "the metrics file)")
    args = parser.parse_args(argv)
    from gigatron.training.observe.plot import default_output_dir, plot_metrics, read_metrics

    output_dir = os.path.abspath(args.output_dir or default_output_dir(args.metrics_file))
    try:
        written = plot_metrics(read_metrics(args.metrics_file), output_dir, args.metrics_file)
    except ValueError as err:
        print(f"gigatron plot: error: {err}", file=sys.stderr)
        return 2
    names = ", ".join(os.path.basename(path) for path in written)
    print(f"wrote {len(written)} plots to {output_dir}: {names}")
    return 0
