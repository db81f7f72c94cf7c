"""`gigatron plot metrics.jsonl`: PNG charts of a run, clear errors for what it cannot draw."""
import json
import sys

import pytest

from gigatron.cli import plot as plot_cli
from gigatron.training.observe.plot import default_output_dir, read_metrics, series

RECORDS = [
    {"type": "train", "iteration": 1, "lm loss": 7.0, "lr": 1e-4, "grad norm": 2.0,
     "tokens_per_s": 900.0, "tflops_per_device": 0.0011, "timers_ms": {"forward": 3.0}},
    {"type": "train", "iteration": 2, "lm loss": 6.0, "lr": 2e-4, "grad norm": 1.5,
     "tokens_per_s": 1000.0, "tflops_per_device": 0.0012},
    {"type": "eval", "split": "valid", "iteration": 2, "lm loss": 6.5, "lm loss PPL": 665.1},
    {"type": "checkpoint", "iteration": 2, "path": "ckpt/iter_0000002", "seconds": 0.1},
    {"type": "summary", "iteration": 2, "tokens_per_s": 950.0},
]


def _write(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def test_series_takes_one_kind_and_split_sorted_by_iteration_last_one_wins():
    records = RECORDS + [{"type": "train", "iteration": 1, "lm loss": 6.9}]
    assert series(records, "train", "lm loss") == ([1, 2], [6.9, 6.0])
    assert series(records, "eval", "lm loss", "valid") == ([2], [6.5])
    assert series(records, "eval", "lm loss", "test") == ([], [])


def test_plots_go_next_to_the_metrics_file_by_default(tmp_path):
    assert default_output_dir(str(tmp_path / "run" / "metrics.jsonl")) == \
        str(tmp_path / "run" / "metrics_plots")


def test_plot_writes_loss_lr_grad_norm_and_throughput_pngs_and_says_where(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = _write(tmp_path / "metrics.jsonl", [json.dumps(r) for r in RECORDS])
    assert plot_cli.main([path]) == 0
    folder = tmp_path / "metrics_plots"
    names = ["loss.png", "lr.png", "grad_norm.png", "throughput.png"]
    for name in names:
        assert (folder / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert capsys.readouterr().out.strip() == f"wrote 4 plots to {folder}: {', '.join(names)}"


def test_plot_without_matplotlib_is_one_error_naming_the_install(tmp_path, capsys,
                                                                 monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = _write(tmp_path / "metrics.jsonl", [json.dumps(r) for r in RECORDS])
    assert plot_cli.main([path]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "matplotlib" in err and "pip install 'gigatron[plot]'" in err


@pytest.mark.parametrize("lines, message", [
    (None, "no metrics file"),
    ([], "is empty"),
    (['{"type": "train", "iteration": 1}', "not json at all"], "line 2: not a JSON record"),
    (['[1, 2, 3]'], "line 1: not a metrics record"),
])
def test_missing_empty_or_garbled_metrics_file_is_an_error_naming_it(tmp_path, capsys, lines,
                                                                     message):
    path = tmp_path / "metrics.jsonl"
    if lines is not None:
        _write(path, lines)
    with pytest.raises(ValueError, match=message) as info:
        read_metrics(str(path))
    assert str(path) in str(info.value)
    assert plot_cli.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gigatron plot: error: ") and str(path) in err


def test_a_file_without_train_or_eval_values_names_itself(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = _write(tmp_path / "m.jsonl", [json.dumps({"type": "checkpoint", "iteration": 1})])
    assert plot_cli.main([path]) == 2
    assert f"{path} has no train or eval records" in capsys.readouterr().err
