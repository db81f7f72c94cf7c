"""Packed documents against one causal stream (issue 40): tokens/s and memory of a tiny GPT's
forward + backward on one sample of s tokens, unmasked and packed with fixed-size documents
(--reset-attention-mask's cu_seqlens: attention per document, never an s x s mask).

Activation memory: the bytes of distinct tensor storages autograd keeps after the forward
(bench_context_parallel.py's method, parameters excluded); on CUDA also the allocator's peak
over the step. Both should stay linear in s and the packed run's close to the stream's; the
packed run's attention does s x document-length work instead of s^2 / 2, so its tokens/s
should rise with s / document length.

    python bench/bench_packed_documents.py                      # 8k and 32k, 1k documents
    python bench/bench_packed_documents.py --seq-lengths 2048 --layers 1 --repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH_DIR)
from bench_context_parallel import held_activation_bytes, tiny_config  # noqa: E402

from gigatron.data.documents import cu_seqlens_from_lengths  # noqa: E402
from gigatron.models.gpt import GPTModel  # noqa: E402


def measure(seq_length: int, document_length: Optional[int], layers: int, hidden: int,
            heads: int, repeats: int, device: torch.device) -> Dict[str, Any]:
    """One row: the stream (document_length None) or packed documents of that length."""
    torch.manual_seed(0)
    config = tiny_config(seq_length, layers, hidden, heads)
    model = GPTModel(config, device=device)
    tokens = torch.randint(0, config.vocab_size, (1, seq_length + 1), device=device)
    kwargs: Dict[str, Any] = dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    if document_length is not None:
        count = -(-seq_length // document_length)
        lengths = [document_length] * (count - 1) + [seq_length - document_length * (count - 1)]
        kwargs["cu_seqlens"] = torch.as_tensor(cu_seqlens_from_lengths(lengths, seq_length))[None]
        positions = torch.arange(seq_length, device=device) % document_length
        kwargs["position_ids"] = positions[None]
    held, loss = held_activation_bytes(model, lambda: model(**kwargs))
    loss.mean().backward()  # warm-up step (kernels chosen, buffers allocated)
    del loss
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(repeats):
        model(**kwargs).mean().backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / repeats
    row = {"seq_length": seq_length, "documents": document_length or "one stream",
           "tokens_per_s": round(seq_length / seconds), "step_ms": round(1000 * seconds, 1),
           "activation_mib": round(held / 2**20, 1)}
    if cuda:
        row["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return row


def table(rows: List[Dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--document-length", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [measure(s, docs, args.layers, args.hidden, args.heads, args.repeats, device)
            for s in args.seq_lengths for docs in (None, args.document_length)]
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"{torch.get_num_threads()} threads; layers {args.layers}, hidden {args.hidden}, "
          f"heads {args.heads}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
