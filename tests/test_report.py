"""`gigatron report`: the table and JSON on this machine, each probe alone with a doctored
environment (no nvcc, nvcc of a given version, no GPU, apex absent or the wrong apex), and
`--comm-check` on two real CPU ranks."""
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from gigatron.cli import report as cli_report
from gigatron.ops import apex_backend, build
from gigatron.ops import report as ops_report
from gigatron.parallel import comm_check, environment

NO_GPU = not torch.cuda.is_available()
JSON_KEYS = {"schema", "gigatron", "python", "torch", "gpus", "comm", "mpirun", "ops", "packages"}


def run_main(capsys, *argv):
    code = cli_report.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def row(out, name):
    """The table line whose dotted name column is `name`."""
    (line,) = [l for l in out.splitlines() if re.match(rf"{re.escape(name)} \.+  ", l)]
    return re.sub(rf"^{re.escape(name)} \.+  ", "", line)


# ---- the report on this machine ----------------------------------------------------------

def test_table_has_every_section_and_aligned_name_column(capsys):
    code, out, _ = run_main(capsys)
    assert code == 0
    for title in ("general", "GPUs", "communication", "kernel toolchain", "fused kernels",
                  "optional packages", "environment variables"):
        assert f"-- {title} --" in out
    dotted = [l for l in out.splitlines() if re.match(r"\S.* \.+  ", l)]
    assert len({l.index(" .") + len(re.search(r" \.+", l).group()) for l in dotted}) == 1
    assert row(out, "torch").startswith(torch.__version__)
    assert row(out, "gloo backend").startswith("yes")


@pytest.mark.skipif(not NO_GPU, reason="checks the no-GPU report")
def test_table_without_gpu_says_why_kernels_cannot_build(capsys):
    _, out, _ = run_main(capsys)
    assert row(out, "CUDA available").startswith("no")
    assert row(out, "GPUs").startswith("none")
    for kernel in ("scaled masked softmax", "causal softmax", "LayerNorm", "RMSNorm"):
        cells = row(out, kernel).split()
        assert cells[:3] == ["no", "no", "torch"], cells
        assert "CPU-only" in row(out, kernel) or "no CUDA device" in row(out, kernel)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc on PATH here")
def test_table_reports_the_installed_nvcc_version(capsys):
    text = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout
    _, out, _ = run_main(capsys)
    assert row(out, "nvcc").startswith(ops_report.parse_nvcc_version(text))


def test_json_follows_the_documented_schema(capsys):
    code, out, _ = run_main(capsys, "--json")
    report = json.loads(out)
    assert code == 0 and set(report) == JSON_KEYS and report["schema"] == 1
    assert report["torch"]["version"] == torch.__version__
    assert [k["op"] for k in report["ops"]["kernels"]] == list(ops_report.KERNELS)
    for kernel in report["ops"]["kernels"]:
        assert set(kernel) == {"op", "name", "built", "jit_buildable", "runs_with", "note"}
        assert kernel["runs_with"] in ("kernel", "apex", "torch")
        assert kernel["note"], "every kernel says where it comes from or why not"
    assert set(report["comm"]["backends"]) >= {"gloo", "nccl", "mpi", "nccl_version"}
    assert {p["name"] for p in report["packages"]} == set(cli_report.PACKAGES)
    if NO_GPU:
        assert report["gpus"] == [] and report["torch"]["cuda_note"]
    for key in ("schema", "gigatron", "gpus", "comm_check", "kernels", "busbw_gbps"):
        assert key in cli_report.__doc__


def test_only_rank_0_of_a_launched_job_prints(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert run_main(capsys) == (0, "", "")


# ---- probes, one at a time ---------------------------------------------------------------

def test_no_nvcc_says_where_it_looked(monkeypatch):
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(ops_report.shutil, "which", lambda name: None)
    info = ops_report.nvcc()
    assert info["found"] is False and info["version"] is None
    assert "no nvcc on PATH" in info["note"] and "CUDA toolkit" in info["note"]


@pytest.mark.parametrize("torch_cuda, note", [("12.4", ""), ("11.8", "differ in major version"),
                                              (None, "")])
def test_nvcc_version_is_read_and_compared_with_torchs_cuda(monkeypatch, tmp_path, torch_cuda, note):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setattr(torch.version, "cuda", torch_cuda)
    seen = []

    def fake_run(argv, timeout=20.0):
        seen.append(argv)
        return True, "nvcc: NVIDIA (R) Cuda compiler driver\nCuda compilation tools, release 12.4, V12.4.131"

    monkeypatch.setattr(ops_report, "run_command", fake_run)
    info = ops_report.nvcc()
    assert seen == [[str(tmp_path / "bin" / "nvcc"), "--version"]]
    assert info["version"] == "12.4.131" and info["cuda_home"] == str(tmp_path)
    assert (note in info["note"]) if note else info["note"] == ""


def test_nvcc_that_prints_no_version_is_reported(monkeypatch):
    monkeypatch.setattr(ops_report, "find_nvcc", lambda: ("/x/nvcc", None))
    monkeypatch.setattr(ops_report, "run_command", lambda argv, timeout=20.0: (False, "Segmentation fault"))
    info = ops_report.nvcc()
    assert info["found"] and info["version"] is None and "Segmentation fault" in info["note"]


def test_cuda_torch_without_a_visible_device(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    info = ops_report.torch_build()
    assert info["cuda"] == "12.4" and info["cuda_available"] is False
    assert "sees no device" in info["cuda_note"] and "CUDA_VISIBLE_DEVICES=" in info["cuda_note"]
    assert ops_report.gpus() == []


def test_each_gpu_is_listed_with_memory_and_compute_capability(monkeypatch):
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=80 * 2**30, major=9,
                            minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    gpus = ops_report.gpus()
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0] == {"index": 0, "name": props.name, "memory_gib": 80.0,
                       "compute_capability": "9.0", "sm_count": 132}


@pytest.mark.parametrize("raw, text", [(90100, "9.1.0"), (8902, "8.9.2"), (None, None)])
def test_cudnn_version_is_decoded(raw, text):
    assert ops_report.cudnn_version_string(raw) == text


FULL = SimpleNamespace(softmax_forward=1, softmax_backward=1, norm_forward=1, norm_backward=1)


def test_prebuilt_kernels_are_built_and_run():
    rows = ops_report.kernel_rows(FULL, "prebuilt: /x.so", "no GPU", apex_ok=False)
    assert all(r["built"] and r["runs_with"] == "kernel" and r["note"] == "prebuilt: /x.so"
               for r in rows)


def test_an_extension_missing_functions_is_not_built():
    partial = SimpleNamespace(softmax_forward=1, softmax_backward=1)
    rows = {r["op"]: r for r in ops_report.kernel_rows(partial, "prebuilt", "no GPU", False)}
    assert rows["scaled_masked_softmax"]["built"] and not rows["rms_norm"]["built"]
    assert "lacks norm_forward, norm_backward" in rows["rms_norm"]["note"]


def test_jit_buildable_kernels_run_as_kernels():
    rows = ops_report.kernel_rows(None, ops_report.NOT_PREBUILT, None, apex_ok=False)
    assert all(not r["built"] and r["jit_buildable"] and r["runs_with"] == "kernel" for r in rows)


def test_without_kernels_norms_fall_back_to_apex_and_softmax_to_torch():
    rows = {r["op"]: r for r in ops_report.kernel_rows(None, ops_report.NOT_PREBUILT,
                                                        "nvcc not found", apex_ok=True)}
    assert rows["layer_norm"]["runs_with"] == rows["rms_norm"]["runs_with"] == "apex"
    assert rows["scaled_masked_softmax"]["runs_with"] == "torch"
    assert rows["layer_norm"]["note"] == "nvcc not found"


def test_a_broken_prebuilt_extension_is_the_reason_given():
    rows = ops_report.kernel_rows(None, "prebuilt but not importable (ImportError: undefined "
                                        "symbol)", "no GPU", apex_ok=False)
    assert all("undefined symbol" in r["note"] for r in rows)


def test_jit_disabled_by_env_is_the_reason(monkeypatch):
    monkeypatch.setattr(build, "toolchain_problem", lambda: None)
    monkeypatch.setenv("GIGATRON_JIT", "0")
    assert "GIGATRON_JIT=0" in ops_report.jit_problem()


def test_kernels_cannot_build_without_a_cuda_torch(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "CPU-only build" in ops_report.jit_problem()


@pytest.fixture
def fake_apex(tmp_path, monkeypatch):
    """A directory to build an `apex` package in, put first on sys.path; cleaned up after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    apex_backend.load_apex.cache_clear()
    yield tmp_path / "apex"
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        del sys.modules[name]
    apex_backend.load_apex.cache_clear()


def test_apex_absent(monkeypatch):
    real = ops_report.importlib.util.find_spec
    monkeypatch.setattr(ops_report.importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("apex") else real(name, *a))
    info = ops_report.apex()
    assert info["installed"] is False and info["available"] is False
    assert "not installed" in info["note"] and "unrelated" in info["note"]


def test_the_pypi_apex_is_not_taken_for_nvidias(fake_apex):
    fake_apex.mkdir()
    (fake_apex / "__init__.py").write_text("# PyPI's apex: pyramid auth, no apex.normalization\n")
    info = ops_report.apex()
    assert info["installed"] and not info["nvidia"] and not info["available"]
    assert "not NVIDIA's" in info["note"]


def test_nvidias_apex_with_fused_norms_is_available(fake_apex):
    (fake_apex / "normalization").mkdir(parents=True)
    (fake_apex / "__init__.py").write_text("")
    (fake_apex / "normalization" / "__init__.py").write_text("")
    (fake_apex / "normalization" / "fused_layer_norm.py").write_text(
        "FusedLayerNormAffineFunction = FusedRMSNormAffineFunction = object\n")
    info = ops_report.apex()
    assert info["nvidia"] and info["available"], info
    rows = cli_report.sections(cli_report.collect())  # the table shows it too
    assert any(r[0] == "NVIDIA Apex" and r[1] == "yes" for _, _, rs in rows for r in rs)


def test_env_vars_lists_named_ones_and_set_prefixed_ones():
    env = {"MASTER_ADDR": "10.0.0.1", "NCCL_DEBUG": "INFO", "GIGATRON_JIT": "0", "HOME": "/root"}
    found = environment.env_vars(env)
    assert found["MASTER_ADDR"] == "10.0.0.1" and found["RANK"] is None
    assert found["NCCL_DEBUG"] == "INFO" and found["GIGATRON_JIT"] == "0" and "HOME" not in found
    assert list(found)[:len(environment.NAMED_VARS)] == list(environment.NAMED_VARS)


def test_launcher_reads_torchrun_and_explains_a_broken_mpi_env():
    assert environment.launcher({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})[
        "launcher"] == "torchrun"
    broken = environment.launcher({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})
    assert broken["launcher"] is None and "MASTER_ADDR" in broken["note"]


def test_nccl_version_is_read_when_nccl_is_built(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert environment.comm_backends()["nccl_version"] == "2.21.5"


@pytest.mark.parametrize("text, parsed", [
    ("mpirun (Open MPI) 4.1.6\n\nReport bugs to http://www.open-mpi.org/community/help/",
     ("Open MPI", "4.1.6")),
    ("HYDRA build details:\n    Version:                                 4.1.2\n", ("MPICH (Hydra)", "4.1.2")),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.6 Build 20220227", ("Intel MPI", "2021.6")),
    ("some other mpirun 1.0", ("some other mpirun 1.0", None)),
])
def test_mpirun_version_is_parsed(text, parsed):
    assert cli_report.parse_mpirun_version(text) == parsed


def test_no_mpirun_says_how_to_get_one(monkeypatch):
    monkeypatch.setattr(cli_report.shutil, "which", lambda name: None)
    info = cli_report.mpirun()
    assert info["found"] is False and "openmpi" in info["note"]


def test_a_missing_package_has_no_version(monkeypatch):
    real = importlib.metadata.version

    def version(name):
        if name == "wandb":
            raise importlib.metadata.PackageNotFoundError(name)
        return "9.9" if name == "mpi4py" else real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    found = {p["name"]: p["version"] for p in cli_report.packages()}
    assert found["wandb"] is None and found["mpi4py"] == "9.9"


# ---- the communication check -------------------------------------------------------------

def test_bus_bandwidth_is_nccl_tests_definition():
    assert comm_check.bus_bandwidth(10.0, 8) == pytest.approx(17.5)
    assert comm_check.bus_bandwidth(10.0, 2) == pytest.approx(10.0)
    assert comm_check.bus_bandwidth(10.0, 1) == 0.0
    (record,) = comm_check.results([2**20], [1e-3], 4)
    assert record["algbw_gbps"] == pytest.approx(1.049, abs=1e-3)
    assert record["busbw_gbps"] == pytest.approx(1.049 * 1.5, abs=1e-3)


def test_sizes_are_read_in_binary_units():
    assert comm_check.parse_sizes("64K, 1M,1.5MiB,4096") == [65536, 2**20, 3 * 2**19, 4096]
    with pytest.raises(ValueError, match="64Q"):
        comm_check.parse_sizes("1M,64Q")


def test_comm_check_misuse_is_one_line(capsys, monkeypatch):
    assert cli_report.main(["--comm-check", "--nproc", "1"]) == 1
    assert capsys.readouterr().err.strip().count("\n") == 0
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli_report.main(["--comm-check", "--nproc", "2"]) == 1
    assert "drop --nproc" in capsys.readouterr().err


def test_comm_check_on_two_cpu_ranks_prints_bus_bandwidth():
    proc = subprocess.run([sys.executable, "-m", "gigatron", "report", "--comm-check", "--nproc",
                           "2", "--comm-sizes", "64K,1M", "--comm-warmup", "1", "--comm-iters", "3"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "all-reduce of float32 over 2 ranks (gloo on cpu" in out
    lines = [l.split() for l in out.splitlines() if re.match(r"\s+(64 KiB|1 MiB)\s", l)]
    assert [l[0] + " " + l[1] for l in lines] == ["64 KiB", "1 MiB"]
    for _, _, time_us, algbw, busbw in lines:
        assert float(time_us) > 0 and float(busbw) == pytest.approx(float(algbw), abs=2e-3)


@pytest.mark.cuda
def test_report_on_a_gpu_lists_it_and_the_kernels_can_run(capsys):
    code, out, _ = run_main(capsys, "--json")
    report = json.loads(out)
    assert code == 0 and report["torch"]["cuda_available"]
    assert len(report["gpus"]) == torch.cuda.device_count()
    assert report["gpus"][0]["name"] == torch.cuda.get_device_name(0)
    assert re.fullmatch(r"\d+\.\d+", report["gpus"][0]["compute_capability"])
    if report["ops"]["nvcc"]["found"] and report["ops"]["ninja"]:
        assert all(k["runs_with"] == "kernel" for k in report["ops"]["kernels"]), report["ops"]
