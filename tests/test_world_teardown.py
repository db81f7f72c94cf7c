"""A process group gigatron creates is really gone after destroy_process_group(): no gloo
thread outlives it into interpreter teardown, where one freeing a finished collective's
tensors aborts the process ("terminate called without an active exception", seen at the
end of Horovod-style scripts under `gigatron launch`). torch._dynamo, which the first
optimizer imports, keeps references to a default group that exists when it is imported."""
import os
import subprocess
import sys
import textwrap

import pytest

from multirank import free_port

SCRIPT = textwrap.dedent("""
    import os, sys, torch, torch.distributed as dist
    from gigatron.parallel.world import init_distributed

    def gloo_threads():
        names = [open(f"/proc/self/task/{t}/comm").read().strip()
                 for t in os.listdir("/proc/self/task")]
        return sorted(n for n in names if "gloo" in n)

    init_distributed()
    dist.all_reduce(torch.ones(4))
    torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # imports torch._dynamo, as in every training script
    running = gloo_threads()
    dist.destroy_process_group()
    print("before", running, "after", gloo_threads())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_destroy_process_group_ends_every_gloo_thread():
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    for name in ("TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert "'pt_gloo_runloop'" in line.split(" after ")[0] and line.endswith(" after []"), line
