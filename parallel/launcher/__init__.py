"""Starting a job's ranks: `gigatron launch` (DeepSpeed's launcher flags, Horovod's -np/-H).

hosts.py     hostfile, --include/--exclude and -H parsing (pure)
plan.py      the per-node plan: hosts, ranks, devices, master, launcher (pure)
ports.py     the master port: the default, or a free one when that is taken on one machine
commands.py  the exact torchrun / pdsh / ssh / mpirun / srun command lines (pure)
node.py      one node's workers through torch's elastic agent (torchrun's flags), reporting
             a failed rank in a few lines instead of the agent's traceback
run.py       the pdsh/ssh/mpirun/srun commands as child processes; the first to fail stops all
failures.py  the short report: which rank failed first, why, its last error lines
worker.py    what each rank runs first: torchrun-style env under any launcher, --local_rank,
             per-rank logs, the failure record

Inside a rank, `gigatron.parallel.world` reads the environment this sets up.
"""
