"""Merge the ranks' timeline parts into one Chrome trace (Trace Event Format, Perfetto).

    python -m gigatron.parallel.timeline_merge t.json    # the parts of a crashed run

A part (`t.json.parts/rankNNNNN.jsonl`, written by `gigatron.parallel.timeline`) is JSON
lines: a header {"part", "rank", "world_size", "host", "pid"}, then batches of spans
{"spans": [[row, name, start ns, end ns, args], ...]}, {"label": ...}, clock references
{"ref": ns} and a final {"end": true}. A line cut short by a crash is skipped.

The trace: "X" events (ts and dur in µs from the earliest span), pid = rank, tid = a row:
1 is the main thread, then other threads, then "comm (async) k" lanes that hold the
collectives in flight without overlapping each other; "M" events name every process
("rank 3 (tp 1, pp 0, dp 1)") and row. Clocks: see `clock_map`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

ASYNC = "comm (async)"
ASYNC_TID = 1000  # first tid of the async lanes, after any thread's


@dataclass
class Part:
    """One rank's recording."""

    rank: int
    world_size: int
    host: str
    label: str = ""
    refs: List[int] = field(default_factory=list)
    events: List[list] = field(default_factory=list)
    complete: bool = False


def read_part(text: str) -> Optional[Part]:
    """A part file's text -> Part (None when even its header is missing)."""
    part: Optional[Part] = None
    for line in text.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue  # cut short by a crash
        if not isinstance(item, dict):
            continue
        if "part" in item:
            part = Part(item["rank"], item["world_size"], item.get("host", ""))
        elif part is not None:
            part.label = item.get("label", part.label)
            part.events += [e for e in item.get("spans", ()) if len(e) == 5]
            if "ref" in item:
                part.refs.append(item["ref"])
            part.complete = part.complete or bool(item.get("end"))
    if part is not None and not part.label:
        part.label = f"rank {part.rank}"
    return part


def clock_map(part: Part, leader: Part, rank0: Part) -> Callable[[int], float]:
    """ns on `part`'s clock -> ns on rank 0's. A host shares one monotonic clock, so ranks on
    rank 0's host need nothing; another host (its lowest rank is `leader`) is mapped through
    the reference points both took after the same barriers: shifted by one, or linear
    between the first and last (drift) when there are two or more."""
    if part.host == rank0.host:
        return float
    pairs = list(zip(leader.refs, rank0.refs))
    if not pairs:
        return float
    (a0, b0), (a1, b1) = pairs[0], pairs[-1]
    rate = (b1 - b0) / (a1 - a0) if a1 != a0 else 1.0
    return lambda t: b0 + (t - a0) * rate


def assign_lanes(spans: Sequence[Sequence[int]]) -> List[int]:
    """Lane index for each (start, end): a span goes to the first lane free by its start, so
    spans in one lane never overlap (interval partitioning, fewest lanes)."""
    lanes: List[int] = []  # end of each lane's last span
    out = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: (spans[i][0], -spans[i][1])):
        start, end = spans[i][0], spans[i][1]
        free = next((k for k, last in enumerate(lanes) if last <= start), None)
        if free is None:
            free = len(lanes)
            lanes.append(end)
        lanes[free] = end
        out[i] = free
    return out


def _rows(part: Part) -> Dict[str, int]:
    """tid of each thread row: the main thread first, then threads in order of appearance."""
    names = ["main thread"] + [e[0] for e in part.events if e[0] != ASYNC]
    return {name: tid for tid, name in enumerate(dict.fromkeys(names), start=1)}


def _metadata(pid: int, tid: int, kind: str, name: str, index: int) -> List[dict]:
    base = {"ph": "M", "pid": pid, "tid": tid, "ts": 0}
    return [{**base, "name": f"{kind}_name", "args": {"name": name}},
            {**base, "name": f"{kind}_sort_index", "args": {"sort_index": index}}]


def _part_events(part: Part, to_ns: Callable[[int], float], origin: float) -> List[dict]:
    rows = _rows(part)
    in_flight = [e for e in part.events if e[0] == ASYNC]
    lanes = assign_lanes([(e[2], e[3]) for e in in_flight])
    lane_of = {id(e): lane for e, lane in zip(in_flight, lanes)}
    out = _metadata(part.rank, 0, "process", part.label, part.rank)
    for name, tid in rows.items():
        out += _metadata(part.rank, tid, "thread", name, tid)
    for lane in range(max(lanes, default=-1) + 1):
        out += _metadata(part.rank, ASYNC_TID + lane, "thread", f"{ASYNC} {lane + 1}",
                         ASYNC_TID + lane)
    for e in part.events:
        row, name, start, end, args = e
        tid = ASYNC_TID + lane_of[id(e)] if row == ASYNC else rows[row]
        ts = round((to_ns(start) - origin) / 1000, 3)  # µs; ends rounded alike, so a
        dur = max(0.0, round((to_ns(end) - origin) / 1000, 3) - ts)  # child stays inside
        event = {"name": name, "ph": "X", "pid": part.rank, "tid": tid, "ts": ts,
                 "dur": round(dur, 3)}
        if args:
            event["args"] = args
        out.append(event)
    return out


def build_trace(parts: Sequence[Part], world_size: Optional[int] = None) -> Dict[str, Any]:
    """The merged trace of `parts` (any order), on rank 0's clock (see `clock_map`)."""
    parts = sorted(parts, key=lambda p: p.rank)
    world = world_size or max((p.world_size for p in parts), default=0)
    by_rank = {p.rank: p for p in parts}
    rank0 = by_rank.get(0, parts[0] if parts else None)
    leaders: Dict[str, Part] = {}
    for p in parts:
        leaders.setdefault(p.host, p)
    maps = {p.rank: clock_map(p, leaders[p.host], rank0) for p in parts} if rank0 else {}
    starts = [maps[p.rank](e[2]) for p in parts for e in p.events]
    origin = min(starts, default=0.0)
    events: List[dict] = []
    for p in parts:
        events += _part_events(p, maps[p.rank], origin)
    hosts = sorted(leaders)
    other = {"world_size": world, "ranks": sorted(by_rank),
             "missing_ranks": [r for r in range(world) if r not in by_rank],
             "incomplete_ranks": [p.rank for p in parts if not p.complete],
             "clock": "perf_counter_ns; one host" if len(hosts) < 2 else
                      "perf_counter_ns per host, mapped onto rank 0's by barrier references",
             "hosts": hosts}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


def write_trace(path: str, trace: Dict[str, Any]) -> str:
    """Write atomically (a reader never sees half a trace); returns the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(trace, f, separators=(",", ":"))
    os.replace(tmp, path)
    return path


def _remove_parts(path: str, parts: Sequence[str]) -> None:
    for name in parts:
        try:
            os.remove(name)
        except OSError:
            pass
    try:
        os.rmdir(path + ".parts")
    except OSError:
        pass  # other ranks' parts (another host) or a stale one: left for the merge command


def _read(name: str) -> str:
    with open(name) as f:
        return f.read()


def gather_and_write(path: str, part_file: str, rank: int) -> Optional[str]:
    """Collective: every rank's part goes to rank 0 (world gather), which writes the trace;
    each rank then removes its part. Returns the path on rank 0."""
    import torch.distributed as dist

    texts: Optional[List[Any]] = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(_read(part_file), texts, dst=0)
    written: List[Optional[str]] = [None]
    if rank == 0:
        assert texts is not None
        parts = [p for p in (read_part(t) for t in texts) if p is not None]
        written[0] = write_trace(path, build_trace(parts, len(texts)))
    dist.broadcast_object_list(written, src=0)  # parts stay if rank 0 could not write
    if written[0] is not None:
        _remove_parts(path, [part_file])
    return written[0] if rank == 0 else None


def _part_files(path: str) -> List[str]:
    folder = path + ".parts"
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder)
                  if n.startswith("rank") and n.endswith(".jsonl"))


def read_parts(path: str, world_size: Optional[int] = None) -> List[Part]:
    """The parts next to `path` (ranks below `world_size`, which rank 0's header gives when
    None: a stale part of a larger earlier run is left out)."""
    parts = [p for p in (read_part(_read(n)) for n in _part_files(path)) if p is not None]
    if world_size is None:
        world_size = next((p.world_size for p in parts if p.rank == 0),
                          max((p.rank + 1 for p in parts), default=0))
    return [p for p in parts if p.rank < world_size]


def merge_files(path: str, world_size: int, wait_s: float = 0.0) -> str:
    """Merge the part files next to `path` once all `world_size` are complete, or after
    `wait_s` seconds with what is there (naming what is missing); removes them when all
    were complete. Returns the trace's path."""
    deadline = time.monotonic() + wait_s
    while True:
        parts = read_parts(path, world_size)
        complete = len(parts) == world_size and all(p.complete for p in parts)
        if complete or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    trace = build_trace(parts, world_size)
    write_trace(path, trace)
    other = trace["otherData"]
    if other["missing_ranks"] or other["incomplete_ranks"]:
        print(f"gigatron timeline: {path} lacks ranks {other['missing_ranks']} and has ranks "
              f"{other['incomplete_ranks']} cut short (crashed, or still running: merge again "
              f"with `python -m gigatron.parallel.timeline_merge {path}`)", file=sys.stderr)
    elif complete:
        _remove_parts(path, _part_files(path))
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m gigatron.parallel.timeline_merge t.json`: merge the parts next to it."""
    parser = argparse.ArgumentParser(description="Merge the per-rank timeline parts "
                                     "(t.json.parts/) into one Chrome trace t.json.")
    parser.add_argument("trace", help="the trace's path, as given to --timeline")
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks of the run (default: from rank 0's part)")
    args = parser.parse_args(argv)
    parts = read_parts(args.trace, args.world_size)
    if not parts:
        print(f"timeline_merge: no parts in {args.trace}.parts/", file=sys.stderr)
        return 1
    world = args.world_size or max(p.world_size for p in parts)
    merge_files(args.trace, world)
    print(f"{args.trace}: {len(parts)} of {world} ranks merged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
