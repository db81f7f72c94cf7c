"""bench/bench_packed_documents.py at a tiny size: packed documents keep the activations of
one stream (within 20%: linear in the sequence, no sequence x sequence tensor), and they
stay so at 4 x the length (the per-token activations grow by less than 15%, the
rounding of 0.1 MiB; an s x s tensor would make them 4 x)."""
import os
import sys

BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")


def test_packed_documents_keep_activation_memory_linear():
    sys.path.insert(0, BENCH_DIR)
    try:
        import bench_packed_documents as bench
    finally:
        sys.path.remove(BENCH_DIR)
    import torch

    rows = {(s, docs): bench.measure(s, docs, 1, 32, 2, 1, torch.device("cpu"))
            for s in (256, 1024) for docs in (None, 64)}
    for s in (256, 1024):
        assert rows[s, 64]["activation_mib"] <= 1.2 * rows[s, None]["activation_mib"]
    per_token = [rows[s, 64]["activation_mib"] / s for s in (256, 1024)]
    assert per_token[1] <= 1.15 * per_token[0]  # s x s would be 4 x; 0.1 MiB rounding
