"""--data-args-path and --per-split-data-args-path: Megatron-LM reads the data paths from a
file (its words; a JSON of the three splits) in place of --data-path and
--train/valid/test-data-path."""
import json

import pytest

from gigatron.training.config.arguments import parse_flags


def test_data_args_path_reads_weights_and_prefixes_from_the_file(tmp_path):
    args = tmp_path / "data_args.txt"
    args.write_text("0.3 /data/a_text_document\n0.7  /data/b_text_document\n")
    flags = parse_flags(["--data-args-path", str(args)])
    assert flags.data_path == ["0.3", "/data/a_text_document", "0.7", "/data/b_text_document"]


def test_per_split_data_args_path_reads_each_split_as_a_list_or_a_string(tmp_path):
    args = tmp_path / "splits.json"
    args.write_text(json.dumps({"train": "0.5 /d/a 0.5 /d/b", "valid": ["/d/v"],
                                "test": "/d/t"}))
    flags = parse_flags(["--per-split-data-args-path", str(args)])
    assert (flags.train_data_path, flags.valid_data_path, flags.test_data_path) == (
        ["0.5", "/d/a", "0.5", "/d/b"], ["/d/v"], ["/d/t"])


def test_the_file_and_the_flag_are_exclusive_and_a_missing_file_is_one_line(tmp_path):
    args = tmp_path / "data_args.txt"
    args.write_text("/d/a")
    with pytest.raises(ValueError, match="--data-args-path and --data-path are exclusive"):
        parse_flags(["--data-args-path", str(args), "--data-path", "/d/b"])
    with pytest.raises(ValueError, match="--per-split-data-args-path and --train-data-path"):
        parse_flags(["--per-split-data-args-path", str(args), "--train-data-path", "/d/b"])
    with pytest.raises(ValueError, match=r"--data-args-path \S+nope: cannot read it"):
        parse_flags(["--data-args-path", str(tmp_path / "nope")])
