"""docs/MEGATRON.md is generated from the config table and Megatron's flag lists: it is
current, it places every Megatron flag, every default that differs from Megatron's says why,
and an unknown Megatron flag is answered with the reason it is not supported."""
import os

import pytest

from gigatron.training.config.arguments import parse_flags
from gigatron.training.config.table import table
from gigatron.training.config.megatron.doc import (DIFFERENT_DEFAULTS, FAMILY_REASONS, NOT_SUPPORTED,
                                            SUPPORTED, default_differences, megatron_flag_note,
                                            megatron_markdown, status)
from gigatron.training.config.megatron.catalog import MEGATRON_DEEPSPEED, MEGATRON_LM, entries

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_megatron_md_is_generated_from_the_table():
    with open(os.path.join(ROOT, "docs", "MEGATRON.md")) as f:
        assert f.read() == megatron_markdown(), \
            "regenerate: python -m gigatron.training.config.megatron.doc > docs/MEGATRON.md"


@pytest.mark.parametrize("doc", ["FLAGS.md", "MEGATRON.md"])
def test_the_generated_docs_name_source_files_that_exist_in_the_checkout(doc):
    """docs/FLAGS.md once named gigatron/training/config_table.py: a reader of the checkout
    must find each .py path a generated doc names."""
    import re

    with open(os.path.join(ROOT, "docs", doc)) as f:
        paths = re.findall(r"`([\w/]+\.py)`", f.read())
    assert paths, f"docs/{doc} names its generator's sources"
    missing = [p for p in paths if not os.path.isfile(os.path.join(ROOT, p))]
    assert not missing, f"docs/{doc} names {missing}, not files of the checkout"


def test_every_megatron_flag_is_listed_once_with_a_status():
    text = megatron_markdown()
    flags = [names for source in (MEGATRON_LM, MEGATRON_DEEPSPEED)
             for _, names, _ in entries(source)]
    assert len(list(entries(MEGATRON_LM))) == 838  # Megatron-LM d98e8a64's parser
    assert len(list(entries(MEGATRON_DEEPSPEED))) == 115
    for names in flags:
        assert f"`{names[0]}`" in text, names
    assert len({n for names in flags for n in names}) == sum(len(n) for n in flags)
    assert set(FAMILY_REASONS) <= set(MEGATRON_LM) | set(MEGATRON_DEEPSPEED)


def test_rows_with_a_megatron_flag_are_reported_supported_or_why_not():
    megatron = {n: family for source in (MEGATRON_LM, MEGATRON_DEEPSPEED)
                for family, names, _ in entries(source) for n in names}
    for row in table():
        shared = [f for f in row.spec.flags if f in megatron]
        if shared:
            state, found, _ = status((shared[0],), megatron[shared[0]])
            assert found is row and state != NOT_SUPPORTED, row.flag
    assert status(("--num-layers",), "network size")[0] == SUPPORTED
    assert status(("--split",), "data and dataloader")[0] == SUPPORTED


def test_every_default_that_differs_from_megatrons_is_explained_and_none_is_stale():
    differing = {flag for flag, _, _ in default_differences()}
    assert differing == set(DIFFERENT_DEFAULTS), \
        "explain a new difference in DIFFERENT_DEFAULTS (or remove a stale entry)"
    assert "UNEXPLAINED" not in megatron_markdown()


def test_megatron_defaults_a_user_notices_are_megatrons():
    megatron = {names[0]: default for _, names, default in entries(MEGATRON_LM)}
    flags = parse_flags([])
    assert flags.initial_loss_scale == megatron["--initial-loss-scale"] == 2 ** 32
    assert flags.num_workers == megatron["--num-workers"] == 2
    assert flags.tiktoken_num_special_tokens == megatron["--tiktoken-num-special-tokens"]
    assert megatron["--make-vocab-size-divisible-by"] == 128


def test_an_unknown_megatron_flag_says_why_it_is_not_supported():
    assert "FP4, mxfp8 and the other FP8 knobs" in megatron_flag_note("--fp4-format")
    assert megatron_flag_note("--fp8-format") is None  # supported (docs/FP8.md)
    assert megatron_flag_note("--use-tutel").startswith(
        "--use-tutel is a Megatron-DeepSpeed flag gigatron does not support: mixture of experts")
    assert megatron_flag_note("--num-layers") is None  # supported
    assert megatron_flag_note("--bogus") is None  # not Megatron's
    with pytest.raises(ValueError) as err:
        parse_flags(["--fp4-format", "nvfp4", "--bogus", "1"])
    text = str(err.value)
    assert "unknown flag(s) --fp4-format nvfp4 --bogus 1" in text
    assert "--fp4-format is a Megatron flag gigatron does not support: not provided" in text
