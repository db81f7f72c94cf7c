"""8-rank smoke of the launch path and topology: every group all-reduces its rank ids.

    torchrun --nproc-per-node 8 examples/topology_smoke.py --tp 2 --pp 2
"""
import argparse

import torch

from gigatron.parallel import comm
from gigatron.parallel.launch import init_distributed
from gigatron.parallel.topology import STANDARD_GROUPS, ProcessGroups, Topology


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1)
    args = parser.parse_args()
    launch, device = init_distributed()
    topo = Topology.from_world_size(launch.world_size, tp=args.tp, cp=args.cp, pp=args.pp)
    groups = ProcessGroups(topo, launch.rank)
    for name in STANDARD_GROUPS + ("embedding",):
        t = torch.tensor([float(launch.rank)], device=device)
        comm.all_reduce(t, group=groups[name])
        expected = float(sum(groups.ranks(name)))
        if t.item() != expected:
            raise SystemExit(f"rank {launch.rank}: {name} all-reduce gave {t.item()}, "
                             f"expected {expected} from ranks {groups.ranks(name)}")
    comm.barrier()
    if launch.rank == 0:
        print(topo.describe())
        print(f"\nOK: all-reduce over every group of {launch.world_size} ranks "
              f"({launch.launcher} launch, {device.type}) gave the sum of its ranks")


if __name__ == "__main__":
    main()
