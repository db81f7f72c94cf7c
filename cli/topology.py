"""Print which rank does what in a tensor x pipeline x data layout, and in the expert layers."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron topology --world-size 16 --tp 2 --pp 2 [--ep 2 --etp 1]`."""
    from gigatron.parallel.topology import main as topology_main

    return topology_main(argv)
