"""pretrain_gpt.py --help is short (the common flags of each group, one line each) and
--help-all prints every flag of the config table, by group."""
import pytest

from gigatron.training.config.arguments import make_parser
from gigatron.training.config.help import COMMON
from gigatron.training.config.table import CONCERNS, table
from gigatron.training.run.pretrain import main as pretrain_main


def _help(capsys, flag, prog="pretrain_gpt.py"):
    with pytest.raises(SystemExit) as stop:
        pretrain_main([flag], prog=prog)
    out, err = capsys.readouterr()
    assert stop.value.code == 0 and err == "", err
    return out


def test_short_help_is_short_and_points_to_the_full_list(capsys):
    out = _help(capsys, "--help", prog="gigatron pretrain")
    lines = out.splitlines()
    assert len(lines) < 150, len(lines)  # was 1,203
    assert lines[0] == "usage: gigatron pretrain [FLAGS ...]"
    assert "gigatron pretrain --help-all" in out and "docs/FLAGS.md" in out
    for flag in COMMON:
        assert any(line.split()[:1] == [flag] for line in lines), flag
    assert "--no-persist-layer-norm" not in out  # a rarely used flag: --help-all only


def test_short_help_shows_the_groups_in_table_order(capsys):
    """Every group of the table is there: with its common flags, in the table's order, or
    named among the groups only --help-all shows (a group added later lands there)."""
    out = _help(capsys, "-h")
    titles = [title for _, _, title in CONCERNS]
    shown = [title for title in titles if f"\n{title}: " in out]
    assert shown[0] == titles[0] and "parallelism" in shown and "checkpointing" in shown
    at = [out.index(f"\n{title}: ") for title in shown]
    assert at == sorted(at)
    rest = " ".join(out.split("Only in --help-all (flags): ")[1].split())
    for title in set(titles) - set(shown):
        assert title in rest, title


def test_help_all_lists_every_flag_of_the_table(capsys):
    out = _help(capsys, "--help-all")
    assert out.startswith("usage: pretrain_gpt.py [FLAGS ...]\n")  # not 200 lines of usage
    for row in table():
        if row.flag:
            assert row.flag in out, row.flag
    for _, _, title in CONCERNS:
        assert f"\n{title}:\n" in out, title


def test_every_common_flag_is_a_flag_of_the_table():
    flags = {f for row in table() for f in row.spec.flags}
    assert COMMON <= flags, sorted(COMMON - flags)


def test_help_flags_are_not_settings():
    parsed = make_parser().parse_args(["--mock-data"])
    assert not hasattr(parsed, "help") and not hasattr(parsed, "help_all")
