"""Draw a pipeline schedule as a per-rank time grid, bubbles included."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron schedule [--schedule zbv] --pp 4 --num-microbatches 8 [--json]`."""
    from gigatron.parallel.pipeline.render import main as render_main

    return render_main(argv)
