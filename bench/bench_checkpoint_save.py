"""Save time of each non-persistent checkpoint kind against a persistent --save (issue 30).

The real training program (pretrain_gpt's main) runs on forked gloo ranks (dp, ZeRO 1) with
a model of a few hundred MB of state, saving every iteration: a persistent torch_dist
checkpoint (--save-interval 1), or a global / local / in_memory non-persistent one
(--non-persistent-save-interval 1; its run ends with one persistent save, not counted).
Each save's time is the loop's own "checkpoint" event (the call to save until the files are
published, all ranks agreed); the table shows the median over the run's saves and the MiB
one checkpoint keeps on disk or in memory (in_memory: every rank's state twice, own + peer).

    python bench/bench_checkpoint_save.py                          # 2 ranks, ~29M params
    python bench/bench_checkpoint_save.py --hidden-size 256 --iters 3 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from typing import Any, Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(BENCH_DIR, "..", "tests"))
from multirank import run_on_ranks  # noqa: E402

KINDS = ("persistent", "global", "local", "in_memory")


def _flags(args: argparse.Namespace) -> List[str]:
    return (f"--num-layers {args.layers} --hidden-size {args.hidden_size} "
            f"--num-attention-heads 8 --seq-length 32 --micro-batch-size 1 "
            f"--global-batch-size {args.ranks} --lr 1e-4 --mock-data --vocab-size 1024 "
            f"--make-vocab-size-divisible-by 8 --train-iters {args.iters} --eval-iters 0 "
            f"--log-interval 1 --no-progress --num-workers 0 --zero-stage 1 "
            f"--no-check-for-nan-in-loss-and-grad").split()


def _kind_flags(kind: str, work: str, shm: str) -> List[str]:
    ckpt = os.path.join(work, kind)
    flags = ["--save", ckpt]
    if kind == "persistent":
        return flags + ["--save-interval", "1"]
    return flags + ["--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", kind,
                    "--non-persistent-local-ckpt-dir",
                    shm if kind == "in_memory" else os.path.join(work, "local_disk")]


def _train(rank: int, world: int, argv: List[str], kept: str, last: int,
           size_file: str) -> int:
    """pretrain_gpt's main on this rank (its console output discarded); rank 0 writes the
    bytes under `kept` before the last iteration into `size_file` (the final persistent
    save then deletes the non-persistent checkpoints)."""
    import contextlib
    import io

    from gigatron.training.run import loop, pretrain

    real_step = loop.train_step

    def step(s: Any, batches: Any, progress: Any) -> Any:
        if rank == 0 and progress.iteration == last - 1:
            with open(size_file, "w") as f:
                f.write(str(_bytes_under(kept)))
        return real_step(s, batches, progress)
    loop.train_step = step
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return pretrain.main(argv)


def _bytes_under(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(path)
               for f in names)


def measure(kind: str, args: argparse.Namespace, work: str, shm: str) -> Dict[str, Any]:
    """Median save seconds of `kind` and the bytes its newest checkpoint holds."""
    metrics = os.path.join(work, f"{kind}.jsonl")
    argv = _flags(args) + _kind_flags(kind, work, shm) + ["--metrics-file", metrics]
    kept = {"persistent": os.path.join(work, kind), "global": os.path.join(work, kind,
            "non_persistent"), "local": os.path.join(work, "local_disk"), "in_memory": shm}[kind]
    size_file = os.path.join(work, f"{kind}.bytes")
    codes = run_on_ranks(_train, args.ranks, argv, kept, args.iters, size_file, timeout=1800)
    assert codes == [0] * args.ranks, codes
    with open(metrics) as f:
        saves = [r for r in map(json.loads, f) if r.get("type") == "checkpoint"]
    persistent = kind == "persistent"
    times = [r["seconds"] for r in saves if persistent or r["iteration"] < args.iters]
    with open(size_file) as f:
        kept_mb = int(f.read()) / 2 ** 20
    if kind == "persistent":  # every persistent checkpoint is kept: one of them
        kept_mb /= args.iters - 1
    return {"kind": kind, "saves": len(times), "median_s": statistics.median(times),
            "min_s": min(times), "kept_mb": kept_mb}


def main(argv: Optional[List[str]] = None) -> int:
    """Run every kind and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=768)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--shm", default="/dev/shm", help="tmpfs for in_memory")
    parser.add_argument("--work", default=None, help="folder for --save and local (disk)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="bench_ckpt_")
    shm = tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.shm)
    rows = []
    try:
        for kind in KINDS:
            rows.append(measure(kind, args, work, shm))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    base = rows[0]["median_s"]
    print("\n| kind | saves | median s | min s | median vs --save | MiB kept |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['saves']} | {r['median_s']:.3f} | {r['min_s']:.3f} | "
              f"{r['median_s'] / base:.2f}x | {r['kept_mb']:.0f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
