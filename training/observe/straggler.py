"""Which ranks are slow: Megatron's --log-straggler report on every log line.

In a synchronous job every rank's wall time per step is the same (the collectives make the
fast ranks wait for the slow one), so the report compares what each rank spent *working*:
the interval's wall time minus the time its step waited in the pipeline's point-to-point
transfers and the gradient sync's end-of-step wait (the timers' "comm"). A rank made slower
(a throttled device, a sick host, an injected sleep) keeps its extra time; its peers spend
it waiting. The per-rank numbers travel in ONE all-gather of one float per rank at the log
line, which is a host sync already; no step between two log lines reads anything more.

Blind spot: time blocked inside a collective of the forward or backward (tensor, context,
expert parallel) counts as work, so at tp > 1 a straggler's tensor-parallel peers rank next
to it (Megatron's detector, timing the forward step, has the same one).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from gigatron.parallel import comm


@dataclass(frozen=True)
class StragglerReport:
    """The `count` slowest and fastest ranks of an interval, as (rank, ms per step)."""

    slowest: List[Tuple[int, float]]
    fastest: List[Tuple[int, float]]

    def fields(self) -> Dict[str, List[List[float]]]:
        """The JSON form: {"slowest": [[rank, ms], ...], "fastest": [...]}."""
        return {"slowest": [[r, ms] for r, ms in self.slowest],
                "fastest": [[r, ms] for r, ms in self.fastest]}


def rank_step_ms(elapsed_s: float, waited_s: float, steps: int) -> float:
    """This rank's working time per step: wall time less its waits for peers."""
    return 1000 * max(0.0, elapsed_s - waited_s) / steps


def gather_step_ms(step_ms: float, device: torch.device) -> List[float]:
    """Every rank's `step_ms`, indexed by global rank: one all-gather and one host read."""
    world = comm.group_size()
    dtype = torch.float64 if device.type == "cpu" else torch.float32
    mine = torch.tensor([step_ms], dtype=dtype, device=device)
    every = torch.empty(world, dtype=dtype, device=device)
    comm.all_gather(every, mine)
    return every.tolist()


def fields_over_ranks(elapsed_s: float, waited_s: float, steps: int, count: int,
                      device: torch.device) -> Dict[str, List[List[float]]]:
    """Collective: the interval's report over every rank, in its JSON form."""
    return report(gather_step_ms(rank_step_ms(elapsed_s, waited_s, steps), device),
                  count).fields()


def report(step_ms: List[float], count: int) -> StragglerReport:
    """The `count` slowest (slowest first) and fastest (fastest first) ranks."""
    ranked = sorted(enumerate(step_ms), key=lambda rank_ms: (rank_ms[1], rank_ms[0]))
    count = min(count, len(ranked))
    return StragglerReport(slowest=ranked[::-1][:count], fastest=ranked[:count])


def format_line(fields: Dict[str, List[List[float]]]) -> str:
    """Megatron's shape, 'MnRtt/Rnk: 101.2ms/0 | MxRtt/Rnk: 152.3ms/3', then the K slowest
    and fastest and the slowest rank named with its excess over the fastest."""
    slowest, fastest = fields["slowest"], fields["fastest"]

    def listed(pairs: List[List[float]]) -> str:
        return ", ".join(f"{ms:.1f}ms/{int(rank)}" for rank, ms in pairs)

    (slow_rank, slow_ms), (fast_rank, fast_ms) = slowest[0], fastest[0]
    ratio = f"{slow_ms / fast_ms:.2f}x" if fast_ms > 0 else "n/a"
    return (f" straggler | MnRtt/Rnk: {fast_ms:.1f}ms/{int(fast_rank)} | MxRtt/Rnk: "
            f"{slow_ms:.1f}ms/{int(slow_rank)} | slowest: {listed(slowest)} | fastest: "
            f"{listed(fastest)} | slowest rank {int(slow_rank)} works {ratio} the fastest's "
            f"time per step |")
