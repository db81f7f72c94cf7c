"""What `gigatron launch` runs on each rank, from any folder: a script by its path; a bare
name not in the folder from the installed scripts or PATH (`pretrain_gpt.py`, which pip put
next to the command); `gigatron COMMAND` (or `$(which gigatron) COMMAND`, a shell shim under
pyenv) as the gigatron command, without the --local_rank its commands do not take."""
import os
import socket
import subprocess
import sys
import sysconfig

import pytest

from gigatron.parallel.launcher.worker import (find_script, is_gigatron_command,
                                               script_not_found)

SCRIPT = "import os, sys\nprint('rank', os.environ['RANK'], 'argv', sys.argv[1:])\n"
SHIM = '#!/usr/bin/env bash\nexec "$(pyenv which "${0##*/}")" "$@"\n'  # how pyenv's look


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """(an empty working folder, a folder on PATH holding a script and a shim)."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (bin_dir / "on_path.py").write_text(SCRIPT)
    (bin_dir / "shimmed.py").write_text(SHIM)
    monkeypatch.chdir(work)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return work, bin_dir


def test_a_path_is_taken_as_given(folders):
    work, bin_dir = folders
    (work / "here.py").write_text(SCRIPT)
    assert find_script("here.py") == "here.py"
    assert find_script(str(bin_dir / "on_path.py")) == str(bin_dir / "on_path.py")
    assert find_script("./missing.py") is None  # a path is not looked up elsewhere


def test_a_bare_name_comes_from_the_installed_scripts_then_path(folders):
    _, bin_dir = folders
    assert find_script("on_path.py") == str(bin_dir / "on_path.py")
    installed = os.path.join(sysconfig.get_path("scripts"), "pretrain_gpt.py")
    if os.path.isfile(installed):  # pip installed it next to this Python's `gigatron`
        assert find_script("pretrain_gpt.py") == installed
    assert find_script("missing.py") is None


def test_a_shell_shim_is_not_run_as_python(folders):
    _, bin_dir = folders
    assert find_script("shimmed.py") is None
    assert find_script(str(bin_dir / "shimmed.py")) is None
    assert "is not a Python script" in script_not_found(str(bin_dir / "shimmed.py"))
    assert script_not_found("missing.py").endswith(
        "or on PATH: give its path (the gigatron command: `gigatron launch ... gigatron "
        "pretrain ...`)")


def test_gigatron_or_a_path_to_it_is_the_command():
    assert is_gigatron_command("gigatron") and is_gigatron_command("/usr/local/bin/gigatron")
    assert not is_gigatron_command("gigatron.py") and not is_gigatron_command("pretrain_gpt.py")


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_ranks_run_the_command_through_a_shim_and_a_script_from_path(folders):
    """Whole programs, from a folder holding neither: `gigatron launch --num_gpus 2
    /path/to/gigatron topology ...` (a pyenv-style shell shim: the command runs in the
    rank's Python, and gets no --local_rank it would refuse), then a script found on PATH
    (with --local_rank, DeepSpeed's convention for scripts)."""
    work, bin_dir = folders
    (bin_dir / "gigatron").write_text(SHIM)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    launch = [sys.executable, "-m", "gigatron", "launch", "--num_gpus", "2"]
    proc = subprocess.run(launch + ["--master_port", str(_free_port()), str(bin_dir / "gigatron"),
                                    "topology", "--world-size", "4", "--tp", "2"],
                          cwd=work, env=env, text=True, capture_output=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("world size 4: tp=2 dp=2 pp=1") == 2, proc.stdout
    proc = subprocess.run(launch + ["--master_port", str(_free_port()), "on_path.py", "x"],
                          cwd=work, env=env, text=True, capture_output=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [
        f"rank {r} argv ['--local_rank={r}', 'x']" for r in range(2)]
