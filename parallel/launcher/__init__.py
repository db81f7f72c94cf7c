"""Starting a job's ranks: `gigatron launch` (DeepSpeed's launcher flags, Horovod's -np/-H).

hosts.py     hostfile, --include/--exclude and -H parsing (pure)
plan.py      the per-node plan: hosts, ranks, devices, master, launcher (pure)
commands.py  the exact torchrun / pdsh / ssh / mpirun / srun command lines (pure)
run.py       starting them: this node through torch's elastic agent, others as processes,
             and a short report naming the rank that failed
worker.py    what each rank runs first: torchrun-style env under any launcher, --local_rank,
             per-rank logs, the failure record

Inside a rank, `gigatron.parallel.launch` reads the environment this sets up.
"""
