"""`pip install .` ships a working product: the wheel's file list and the console command.

The full install-and-train check from outside the repository is .ci/wheel_smoke.sh (a fresh
venv costs too long for the suite); here the wheel is built and its contents inspected.
"""
import configparser
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory):
    """Names in a wheel built (without dependencies) from a copy of the repository."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", "build", "*.egg-info", "__pycache__", "runs", "my-data"))
    # with the installed setuptools (torch requires it): the files are the same, and a build
    # in an isolated env (setuptools installed into it first) is .ci/wheel_smoke.sh's check;
    # 4.7 -> 1.7 CPU-s here
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                           "--no-build-isolation", str(src), "-w", str(tmp / "dist")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("gigatron-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        parser = configparser.ConfigParser()
        parser.read_string(zf.read(entry_points).decode())
    return names, dict(parser["console_scripts"])


def test_wheel_holds_every_zoo_config(wheel_files):
    names, _ = wheel_files
    zoo = sorted(f for f in os.listdir(os.path.join(REPO, "models", "zoo")) if f.endswith(".json"))
    assert len(zoo) >= 10
    missing = [f for f in zoo if f"gigatron/models/zoo/{f}" not in names]
    assert not missing


def test_wheel_holds_the_kernel_sources_where_ops_build_looks(wheel_files):
    from gigatron.ops.build import SOURCES

    names, _ = wheel_files
    csrc = sorted(os.listdir(os.path.join(REPO, "csrc")))
    assert set(SOURCES) <= set(csrc)
    missing = [f for f in csrc if f"gigatron/csrc/{f}" not in names]
    assert not missing


def test_wheel_has_the_console_command_and_megatron_scripts(wheel_files):
    names, console = wheel_files
    assert console == {"gigatron": "gigatron.cli:main"}
    assert {"gigatron/__main__.py", "gigatron/cli/__init__.py", "gigatron/cli/pretrain.py",
            "gigatron/data/preprocess.py"} <= names
    scripts = {n.rsplit("/", 1)[1] for n in names if ".data/scripts/" in n}
    assert scripts == {"pretrain_gpt.py", "preprocess_data.py", "train_tokenizer.py"}
    # nothing from tests/, bench/ or a build directory slips in
    assert not [n for n in names if n.startswith(("tests/", "bench/", "build/", "gigatron/tests"))]
