"""Launch environment: rank/world/master read from torchrun, SLURM and MPI variables."""
import pytest

from gigatron.parallel.world import (LaunchEnv, device_and_backend, first_slurm_host,
                                      read_launch_env, require_world_size)


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
           "MASTER_PORT": "6000"}
    assert read_launch_env(env) == LaunchEnv(5, 16, 1, "node7", 6000, "torchrun")


def test_slurm_variables_use_first_host_of_nodelist():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "32", "SLURM_LOCALID": "1",
           "SLURM_NODELIST": "gpu[012-015,020],login1"}
    launch = read_launch_env(env)
    assert launch == LaunchEnv(9, 32, 1, "gpu012", 29500, "slurm")


def test_explicit_master_addr_wins_under_slurm():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "a[1-2]",
           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    assert read_launch_env(env).master_addr == "10.0.0.1"


@pytest.mark.parametrize("nodelist, host", [
    ("node1", "node1"), ("gpu[003-005,9]", "gpu003"), ("a[7],b[1-2]", "a7"),
    ("x-y[10-11]", "x-y10"), ("n1,n2", "n1")])
def test_first_slurm_host(nodelist, host):
    assert first_slurm_host(nodelist) == host


def test_open_mpi_variables():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_RANK": "3", "MASTER_ADDR": "head"}
    assert read_launch_env(env) == LaunchEnv(3, 4, 3, "head", 29500, "mpi")


def test_pmi_variables():
    env = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MASTER_ADDR": "h"}
    assert read_launch_env(env) == LaunchEnv(1, 2, 1, "h", 29500, "mpi")


def test_mpi_without_master_addr_names_the_fix():
    with pytest.raises(ValueError, match="export MASTER_ADDR"):
        read_launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4"})


def test_mpirun_on_one_host_needs_no_master_addr():
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
           "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert read_launch_env(env) == LaunchEnv(1, 2, 1, "127.0.0.1", 29500, "mpi")
    hydra = {"PMI_RANK": "0", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "3"}
    assert read_launch_env(hydra).master_addr == "127.0.0.1"


def test_mpirun_across_hosts_without_master_addr_names_the_fix():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match="several hosts without MASTER_ADDR: export MASTER_ADDR"):
        read_launch_env(env)


def test_no_launcher_is_a_single_process():
    assert read_launch_env({}) == LaunchEnv(0, 1, 0, "127.0.0.1", 29500, "none")


def test_no_launcher_but_more_ranks_needed_says_how_to_launch():
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 8"):
        require_world_size(read_launch_env({}), 8)
    require_world_size(read_launch_env({}), 1)


def test_launched_size_must_match():
    env = read_launch_env({"RANK": "0", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="needs 8 ranks but was launched with 4"):
        require_world_size(env, 8)


def test_non_integer_rank_is_named():
    with pytest.raises(ValueError, match="RANK='x'"):
        read_launch_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_cpu_machine_uses_gloo():
    import torch
    device, backend = device_and_backend()
    if not torch.cuda.is_available():
        assert (device.type, backend) == ("cpu", "gloo")
    else:
        assert (device.type, backend) == ("cuda", "nccl")


def test_current_device_is_cpu_without_accelerator():
    import torch
    from gigatron.parallel.world import current_device
    if not torch.accelerator.is_available():
        assert current_device() == torch.device("cpu")
    else:
        assert current_device().index == torch.accelerator.current_device_index()
