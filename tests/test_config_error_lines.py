"""A malformed DeepSpeed config is one line (issue 38): `gigatron.initialize` raises a
ConfigError naming the file, line and column, with none of the reader's frames; a script run
by `gigatron launch` that raises it prints that line alone (rank 0; the launcher's report
names another rank's own), not a traceback."""
from __future__ import annotations

import json
import traceback

import pytest
import torch

import gigatron
from gigatron.parallel.launcher import worker
from gigatron.training.config.validation import ConfigError

BAD = '{"train_batch_size": 8,\n "optimizer": {"type": "Adam" "params": {}}}\n'


def test_initialize_raises_one_line_naming_the_file_line_and_column(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(BAD)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError) as err:
        gigatron.initialize(model=model, model_parameters=model.parameters(),
                            config=str(path))
    assert str(err.value) == (f"DeepSpeed config {path} is not valid JSON: Expecting ',' "
                              f"delimiter at line 2 column 31")
    frames = traceback.extract_tb(err.value.__traceback__)
    assert [f.name for f in frames] == [
        "test_initialize_raises_one_line_naming_the_file_line_and_column", "initialize"]
    assert err.value.__cause__ is None and err.value.__suppress_context__


@pytest.mark.parametrize("rank, printed", [("0", True), ("1", False)])
def test_launched_script_prints_a_config_error_as_one_line(tmp_path, monkeypatch, capsys,
                                                            rank, printed):
    script = tmp_path / "train.py"
    script.write_text("from gigatron.training.config.validation import ConfigError\n"
                      "raise ConfigError(['DeepSpeed config ds.json is not valid JSON'])\n")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr("sys.argv", list(__import__("sys").argv))
    monkeypatch.setattr("sys.path", list(__import__("sys").path))
    record = str(tmp_path / "rank.error.json")
    assert worker.run_script(str(script), [], [record]) == 1
    err = capsys.readouterr().err
    expected = f"{script}: error: DeepSpeed config ds.json is not valid JSON\n"
    assert err == (expected if printed else "")
    with open(record) as f:  # what the launcher's report reads
        assert json.load(f)["message"]["message"] == \
            "ConfigError: DeepSpeed config ds.json is not valid JSON"


def test_a_setting_from_the_deepspeed_config_is_named_by_its_json_key(tmp_path):
    from gigatron.training.config.arguments import parse_args

    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 0, "gradient_clipping": -1}')
    flags = ("--num-layers 1 --hidden-size 16 --num-attention-heads 2 --seq-length 16 "
             "--train-iters 2 --vocab-size 128 --mock-data --deepspeed-config").split()
    with pytest.raises(ConfigError) as err:
        parse_args(flags + [str(path)], 1)
    assert sorted(err.value.problems) == [
        "--lr is required",  # a flag's own problem keeps the flag
        "gradient_clipping (--deepspeed-config) must be >= 0 (0 disables clipping), got -1.0",
        "train_micro_batch_size_per_gpu (--deepspeed-config) must be > 0, got 0"]
