"""Where a profiled step's GPU time goes, by the operator that launched each kernel.

Reads a torch profiler Chrome trace (gzipped or not; bench_train_gpu.py writes one per size),
links every kernel, memcpy and memset to the CPU op that launched it (through the runtime
call's correlation id and the op stack enclosing that call) and prints the GPU busy time,
the idle gaps between kernels, and the top (outer op, inner op) pairs by device time. Costs
no device time: run it here on a trace fetched from the GPU machine.

    python bench/trace_ops.py bench/results/2026-11-26-h200/trace_gpt3-1.3b.json.gz --top 40
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
from typing import Dict, List


def load(path: str) -> List[Dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def enclosing_ops(call: Dict, ops_by_thread: Dict[int, List[Dict]]) -> List[str]:
    """Names of the CPU ops on the call's thread that enclose it, outermost first."""
    names = []
    for op in ops_by_thread[call["tid"]]:
        if op["ts"] > call["ts"]:
            break
        if op["ts"] + op["dur"] >= call["ts"] + call["dur"]:
            names.append(op["name"])
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    events = [e for e in load(args.trace) if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    calls = {e["args"].get("correlation"): e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    ops_by_thread: Dict[int, List[Dict]] = collections.defaultdict(list)
    for op in sorted((e for e in events if e.get("cat") == "cpu_op"), key=lambda e: e["ts"]):
        ops_by_thread[op["tid"]].append(op)
    span = max(e["ts"] + e["dur"] for e in device) - device[0]["ts"]
    busy = sum(e["dur"] for e in device)
    gaps = sum(max(0, b["ts"] - a["ts"] - a["dur"]) for a, b in zip(device, device[1:]))
    print(f"span {span / 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms, idle gaps {gaps / 1e3:.1f} ms, "
          f"{len(device)} kernels/copies")
    time: Dict[tuple, float] = collections.Counter()
    count: Dict[tuple, int] = collections.Counter()
    for e in device:
        call = calls.get(e["args"].get("correlation"))
        names = enclosing_ops(call, ops_by_thread) if call else []
        outer = next((n for n in names if n.startswith("autograd::engine")), names[0] if names
                     else "(no CPU op: " + e["name"][:40] + ")")
        key = (outer[:70], names[-1][:40] if names else "")
        time[key] += e["dur"]
        count[key] += 1
    for key, us in sorted(time.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{us / 1e3:8.2f} ms x{count[key]:<5} {key[0]}  |  {key[1]}")


if __name__ == "__main__":
    main()
