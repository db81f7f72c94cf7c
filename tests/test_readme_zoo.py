"""README.md's model-zoo line is generated from models/zoo (`python -m gigatron.models.zoo
--readme README.md` rewrites it): a model added to or removed from the zoo without
regenerating the line fails here."""
import os

import pytest

from gigatron.models.zoo import list_models
from gigatron.models.zoo.__main__ import PREFIX, main, rewrite, zoo_line

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_lines():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read().split("\n")


def test_readme_lists_exactly_the_zoo():
    (line,) = [line for line in readme_lines() if line.startswith(PREFIX)]
    assert line == zoo_line(), "regenerate: python -m gigatron.models.zoo --readme README.md"
    for name in list_models():
        assert f"`{name}`" in line


def test_the_line_fails_when_the_zoo_changes():
    (line,) = [line for line in readme_lines() if line.startswith(PREFIX)]
    assert line != zoo_line(list_models() + ["gpt-oss-20b"])
    assert line != zoo_line(list_models()[1:])


def test_regenerating_rewrites_only_that_line(tmp_path):
    stale = ["# title", zoo_line(["debug-gpt2"]), "the rest"]
    assert rewrite(stale) == ["# title", zoo_line(), "the rest"]
    path = tmp_path / "README.md"
    path.write_text("\n".join(stale))
    assert main(["--readme", str(path)]) == 0
    assert path.read_text().split("\n") == ["# title", zoo_line(), "the rest"]
    path.write_text("no zoo line here")
    assert main(["--readme", str(path)]) == 1
    with pytest.raises(ValueError):
        rewrite(["no zoo line"])
