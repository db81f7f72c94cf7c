"""The layout keeps its shape: dependencies point one way, folders stay small, DESIGN names them.

The import rule (docs/DESIGN.md, "Layout") is import-linter's contracts in pyproject.toml.
import-linter finds a package's files by walking its folder, and `gigatron` is assembled from
the repository's top-level folders by setup.py's package_dir, so the check runs over a link
tree that lays the folders out as the installed wheel does.
"""
import ast
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODULES_PER_FOLDER = 20


def _top_level() -> list:
    """setup.py's TOP_LEVEL: the folders installed as gigatron.<folder>."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "TOP_LEVEL":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no TOP_LEVEL list")


def _link_tree(where: str) -> str:
    """`where/gigatron/` laid out as installed: package/'s files plus a link per folder."""
    namespace = os.path.join(where, "gigatron")
    os.makedirs(namespace)
    for name in os.listdir(os.path.join(ROOT, "package")):
        if name.endswith(".py"):
            os.symlink(os.path.join(ROOT, "package", name), os.path.join(namespace, name))
    for top in _top_level():
        os.symlink(os.path.join(ROOT, top), os.path.join(namespace, top))
    return where


def _lint_imports(tree: str, config: str) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' installs import-linter")
    env = dict(os.environ, PYTHONPATH=tree)
    return subprocess.run([exe, "--config", config, "--no-cache"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_dependencies_point_one_way(tmp_path):
    result = _lint_imports(_link_tree(str(tmp_path)), os.path.join(ROOT, "pyproject.toml"))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout and "5 kept" in result.stdout, result.stdout[-2000:]


def test_an_upward_import_inside_a_function_breaks_a_contract(tmp_path):
    """The check can fail: parallel/ reaching into training/ from a function body is caught."""
    namespace = tmp_path / "gigatron"
    for top in _top_level():
        (namespace / top).mkdir(parents=True)
        (namespace / top / "__init__.py").write_text("")
    (namespace / "__init__.py").write_text("")
    (namespace / "training" / "loop.py").write_text("X = 1\n")
    (namespace / "parallel" / "comm.py").write_text(
        "def f():\n    from gigatron.training.loop import X\n    return X\n")
    result = _lint_imports(str(tmp_path), os.path.join(ROOT, "pyproject.toml"))
    assert result.returncode != 0
    assert "gigatron.parallel.comm -> gigatron.training.loop" in result.stdout, result.stdout


def _package_folders():
    for top in _top_level() + ["package"]:
        for folder, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            if "__init__.py" in files or folder.endswith("package"):
                yield os.path.relpath(folder, ROOT), [f for f in files if f.endswith(".py")]


def test_no_folder_holds_more_than_twenty_modules():
    crowded = {folder: len(modules) for folder, modules in _package_folders()
               if len(modules) > MAX_MODULES_PER_FOLDER}
    assert crowded == {}, f"give these folders subpackages: {crowded}"


def test_design_layout_names_every_folder():
    design = open(os.path.join(ROOT, "docs", "DESIGN.md")).read()
    layout = design[design.index("## Layout"):]
    layout = layout[:layout.index("```", layout.index("```") + 3)]
    folders = {os.path.basename(folder) + "/" for folder, _ in _package_folders()}
    missing = sorted(f for f in folders if not re.search(rf"(?<![\w]){f}", layout))
    assert missing == [], f"docs/DESIGN.md's layout does not name {missing}"

