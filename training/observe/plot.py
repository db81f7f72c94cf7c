"""Charts of a run from its --metrics-file: loss, learning rate, grad norm, throughput, and for
an MoE model its balancing losses and, per MoE layer, tokens per expert (max/mean) and the
share of dropped tokens.

    gigatron plot runs/quickstart/metrics.jsonl        # -> runs/quickstart/metrics_plots/*.png

matplotlib is an optional extra (`pip install 'gigatron[plot]'`); it is imported only here,
with the non-interactive Agg backend, so plotting works on a headless node.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Tuple

INSTALL_HINT = "pip install 'gigatron[plot]' (or pip install matplotlib)"
Series = Tuple[List[int], List[float]]
SAME_AXIS = ("loss.png", "moe_imbalance.png", "moe_dropped.png")  # one axis, a line per panel


def read_metrics(path: str) -> List[Dict[str, Any]]:
    """The records of a metrics file; a missing, empty or garbled file is a ValueError
    naming it (and the bad line)."""
    if not os.path.isfile(path):
        raise ValueError(f"no metrics file {path} (written by a run with --metrics-file)")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}, line {number}: not a JSON record ({err.msg}); "
                                 "is this a --metrics-file?") from None
            if not isinstance(record, dict) or "type" not in record:
                raise ValueError(f"{path}, line {number}: not a metrics record (no \"type\"); "
                                 "is this a --metrics-file?")
            records.append(record)
    if not records:
        raise ValueError(f"{path} is empty: the run logged no iteration yet "
                         "(records are written every --log-interval iterations)")
    return records


def series(records: List[Dict[str, Any]], kind: str, key: str,
           split: Optional[str] = None) -> Series:
    """(iterations, values) of `key` in records of `kind` (and `split`), by iteration; the
    last record of an iteration wins (a resumed run may repeat some)."""
    points: Dict[int, float] = {}
    for r in records:
        if r.get("type") == kind and (split is None or r.get("split") == split) and \
                r.get(key) is not None:
            points[int(r["iteration"])] = float(r[key])
    iterations = sorted(points)
    return iterations, [points[i] for i in iterations]


def default_output_dir(metrics_file: str) -> str:
    """metrics.jsonl -> metrics_plots/ in the same folder."""
    stem = os.path.splitext(os.path.basename(metrics_file))[0]
    return os.path.join(os.path.dirname(os.path.abspath(metrics_file)), f"{stem}_plots")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f"plotting needs matplotlib, which is not installed: "
                         f"{INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _charts(records: List[Dict[str, Any]]) -> Dict[str, List[Tuple[str, str, Series]]]:
    """File name -> panels (title, y label, series); series may be empty."""
    tflops = series(records, "train", "tflops_per_device")
    if tflops[1] and max(tflops[1]) < 0.1:  # a CPU: GFLOP/s, as the console line says
        flops = ("model FLOPs", "GFLOP/s per device", (tflops[0], [1e3 * v for v in tflops[1]]))
    else:
        flops = ("model FLOPs", "TFLOP/s per device", tflops)
    return {**{
        "loss.png": [("lm loss", "train", series(records, "train", "lm loss")),
                     ("lm loss", "validation", series(records, "eval", "lm loss", "valid")),
                     ("lm loss", "test", series(records, "eval", "lm loss", "test"))],
        "lr.png": [("learning rate", "lr", series(records, "train", "lr"))],
        "grad_norm.png": [("grad norm", "grad norm", series(records, "train", "grad norm"))],
        "throughput.png": [("throughput", "tokens/s", series(records, "train", "tokens_per_s")),
                           flops],
        "moe_losses.png": [("load-balancing loss", "load_balancing_loss",
                            series(records, "train", "load_balancing_loss")),
                           ("z-loss", "z_loss", series(records, "train", "z_loss"))],
    }, **_moe_layer_charts(records)}


def _moe_layer_charts(records: List[Dict[str, Any]]) -> Dict[str, List[Tuple[str, str, Series]]]:
    """moe_imbalance.png and moe_dropped.png: one line per MoE layer (the "moe" field of the
    train records, training/run/moe.py)."""
    names = sorted({name for r in records if r.get("type") == "train"
                    for name in (r.get("moe") or {})},
                   key=lambda n: (n.split("/")[1], int(n.split("/")[0].split("_")[1])))
    flat = [{**r, **{f"moe/{k}": v for k, v in (r.get("moe") or {}).items()}} for r in records]
    charts: Dict[str, List[Tuple[str, str, Series]]] = {}
    for kind, file, title in (("tokens_per_expert_max_over_mean", "moe_imbalance.png",
                               "tokens per expert, max/mean"),
                              ("dropped_token_share", "moe_dropped.png", "dropped token share")):
        charts[file] = [(title, name.split("/")[0].replace("_", " "),
                         series(flat, "train", f"moe/{name}"))
                        for name in names if name.endswith("/" + kind)]
    return charts


def _draw(plt, name: str, panels: List[Tuple[str, str, Series]], path: str) -> None:
    """loss.png: train/validation/test on one axis; other charts: one axis per panel."""
    from matplotlib.ticker import MaxNLocator

    same_axis = name in SAME_AXIS
    rows = 1 if same_axis else len(panels)
    fig, axes = plt.subplots(rows, 1, figsize=(8, 3.2 * rows), squeeze=False, sharex=True)
    for index, (title, label, (xs, ys)) in enumerate(panels):
        ax = axes[0 if same_axis else index][0]
        style = "-" if len(xs) > 1 and label not in ("validation", "test") else "o-"
        ax.plot(xs, ys, style, label=label, markersize=4)
        ax.set_ylabel(label if not same_axis else title)
        ax.grid(True, alpha=0.3)
        if same_axis:
            ax.legend()
    axes[-1][0].set_xlabel("iteration")
    axes[-1][0].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(panels[0][0] if same_axis else name[:-4].replace("_", " "))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_metrics(records: List[Dict[str, Any]], output_dir: str,
                 source: str = "the records") -> List[str]:
    """Writes one PNG per chart that has data into `output_dir`; returns their paths
    (`source` names the records in errors)."""
    plt = _pyplot()
    charts = {name: [p for p in panels if p[2][0]] for name, panels in _charts(records).items()}
    charts = {name: panels for name, panels in charts.items() if panels}
    if not charts:
        raise ValueError(f"{source} has no train or eval records with values to plot")
    os.makedirs(output_dir, exist_ok=True)
    written = []
    for name, panels in charts.items():
        path = os.path.join(output_dir, name)
        _draw(plt, name, panels, path)
        written.append(path)
    return written
