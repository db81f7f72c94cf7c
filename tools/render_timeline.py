#!/usr/bin/env python
"""Draw a merged timeline (--timeline's Chrome trace) as a PNG: one band per rank and row.

    python tools/render_timeline.py t.json t.png                  # the whole run
    python tools/render_timeline.py t.json t.png --iteration 2    # one step, all ranks

For documents and quick looks where ui.perfetto.dev is not at hand. Spans nest on a row,
so deeper spans are drawn thinner over their parents (the step is the pale band behind
its forwards and backwards); forwards and backwards are labelled F<mb>/B<mb>.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List, Optional, Sequence, Tuple

COLOURS = [("forward", "#4c72b0"), ("backward", "#dd8452"), ("send/recv", "#8c8c8c"),
           ("all_reduce", "#c44e52"), ("reduce_scatter", "#6d904f"), ("all_gather", "#937860"),
           ("broadcast", "#c44e52"), ("barrier", "#c44e52"), ("gradient reduction", "#da8bc3"),
           ("optimizer step", "#8172b3"), ("data", "#ccb974"), ("iteration", "#e8e8e8"),
           ("checkpoint", "#64b5cd"), ("evaluation", "#55a868")]


def colour(name: str) -> str:
    """The fill of a span by what it is (first matching prefix or word)."""
    for key, value in COLOURS:
        if name.startswith(key) or key in name:
            return value
    return "#b0b0b0"


def _rows(trace: dict, start: float, end: float
          ) -> Tuple[List[Tuple[int, int]], Dict[Tuple[int, int], str]]:
    """The (pid, tid) rows with a span in [start, end], and their titles."""
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name"}
    ranks = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    used = sorted({(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"
                   and e["ts"] < end and e["ts"] + e["dur"] > start})
    return used, {k: f"{ranks.get(k[0], k[0])}: {names.get(k, k[1])}" for k in used}


def _window(trace: dict, iteration: Optional[int]) -> Tuple[float, float]:
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    if iteration is not None:
        spans = [e for e in spans if e["name"] == f"iteration {iteration}"]
        if not spans:
            raise SystemExit(f"render_timeline: no 'iteration {iteration}' span in the trace")
    return min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)


def _depths(spans: Sequence[dict]) -> List[int]:
    """Nesting depth of each span of one row (spans sorted by start, longest first)."""
    stack: List[float] = []
    out = []
    for e in spans:
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        out.append(len(stack))
        stack.append(e["ts"] + e["dur"])
    return out


def _label(name: str) -> str:
    parts = name.split()
    if parts[0] in ("forward", "backward") and len(parts) >= 3:
        return parts[0][0].upper() + parts[2]
    return ""


def render(trace: dict, out: str, iteration: Optional[int] = None, width: float = 11,
           title: Optional[str] = None) -> None:
    """Write the PNG `out` of `trace` (the span of `iteration N` on all ranks, or all)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start, end = _window(trace, iteration)
    rows, titles = _rows(trace, start, end)
    margin = 0.01 * (end - start)
    fig, ax = plt.subplots(figsize=(width, 0.38 * len(rows) + 1.2), dpi=100)
    for y, row in enumerate(rows):
        spans = sorted((e for e in trace["traceEvents"] if e["ph"] == "X"
                        and (e["pid"], e["tid"]) == row and e["ts"] + e["dur"] >= start
                        and e["ts"] <= end), key=lambda e: (e["ts"], -e["dur"]))
        for e, depth in zip(spans, _depths(spans)):
            height = 0.8 * 0.75 ** depth
            x0, x1 = (max(e["ts"], start) - start) / 1000, (min(e["ts"] + e["dur"], end) -
                                                            start) / 1000
            ax.barh(y, x1 - x0, left=x0, height=height, color=colour(e["name"]),
                    edgecolor="white", linewidth=0.3)
            if _label(e["name"]) and x1 - x0 > (end - start) / 1000 / 90:
                ax.text((x0 + x1) / 2, y, _label(e["name"]), ha="center", va="center",
                        fontsize=6.5, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([titles[r] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(-margin / 1000, (end - start + margin) / 1000)
    ax.set_xlabel("ms" + (f" from the start of iteration {iteration} (rank 0's clock)"
                          if iteration is not None else " from the first span"))
    _legend(ax)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def _legend(ax) -> None:
    from matplotlib.patches import Patch

    shown = ["forward", "backward", "send/recv", "all_reduce", "reduce_scatter", "all_gather",
             "gradient reduction", "optimizer step", "data", "iteration"]
    ax.legend(handles=[Patch(color=colour(n), label=n) for n in shown], fontsize=6.5,
              ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.1),
              frameon=False)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a merged timeline (Chrome trace JSON)")
    parser.add_argument("png", help="the picture to write")
    parser.add_argument("--iteration", type=int, default=None,
                        help="draw only this training iteration (all ranks)")
    parser.add_argument("--width", type=float, default=11, help="inches (default 11)")
    parser.add_argument("--title", default=None, help="a line above the picture")
    args = parser.parse_args(argv)
    with open(args.trace) as f:
        trace = json.load(f)
    render(trace, args.png, args.iteration, args.width, args.title)
    print(f"{args.png}: {args.trace}" + (f", iteration {args.iteration}"
                                         if args.iteration is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
