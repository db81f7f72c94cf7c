"""Context parallelism at long sequence: activation memory per rank and bytes per step (issue 28).

For cp 1, 2, 4 on forked gloo ranks (one cp group of all of them) and each --cp-comm-type,
a tiny fp32 GPT (models/gpt.py with its cp group, as the trainer builds it) runs one
micro-batch's forward and backward on this rank's load-balanced chunks of the sequence.

Activation memory: the bytes of distinct tensor storages autograd keeps for the backward,
after the forward and before the backward (every saved tensor passes a
`saved_tensors_hooks` pack hook and is held weakly, so a storage counts only while a graph
node holds it; parameter storages excluded). That is what the activations cost, without the
weights, gradients or the allocator's caching; it is the method tests/test_plan_memory.py
checks `gigatron plan` against (tests/test_plan_cp.py: equal, byte for byte). It falls as
1/cp under every comm type: all_gather attends block by block and gathers the keys/values
again in its backward, so it keeps what the ring keeps.

Communication: parallel/comm's counters (bytes each rank sends) over the forward and the
backward, against `comm_bytes_formula`. With X = b x s/cp x heads x head_dim x 4 bytes (one
local query-sized tensor; keys/values enter attention at the query heads) per layer:
  p2p         forward (cp-1) x 2X (k and v, cp-1 hops); backward (cp-1) x 2X again plus
              cp x 2X (their gradients, travelling on to the owner)              -> send
  all_gather  forward all-gather of k, v: (cp-1) x 2X; backward the same all-gather again
              and the reduce-scatter of their gradients: (cp-1) x 2X each
                                                              -> all_gather, reduce_scatter
  a2a         q, k, v and the output, forward and backward: 2 x 4X x (cp-1)/cp -> all_to_all
  a2a+p2p     (--comm-types a2a+p2p: A = 2, P = cp/2) a2a's over A: 2 x 4X x (A-1)/A, and the
              ring's over P on the head-split tensors (also X each)     -> all_to_all, send

    python bench/bench_context_parallel.py                        # 8k..32k tokens (slow)
    python bench/bench_context_parallel.py --seq-lengths 1024 --cp 1 2 --layers 1
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(BENCH_DIR, "..", "tests"))
from multirank import run_on_ranks  # noqa: E402

from gigatron.models.config import TransformerConfig  # noqa: E402

COMM_TYPES = ("p2p", "all_gather", "a2a")  # the default rows (gigatron plan models each)
HIERARCHICAL = "a2a+p2p"  # on request: A = 2 (a2a), P = cp / 2 (p2p ring)
TOLERANCE = 0.15  # activation ratio cp1 / cp against cp (issue 28: within 15%)


def tiny_config(seq_length: int, layers: int = 2, hidden: int = 64, heads: int = 4,
                vocab: int = 256) -> TransformerConfig:
    """The bench's model: fp32, RoPE, no dropout (attention dropout is refused under cp)."""
    return TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                             vocab_size=vocab, make_vocab_size_divisible_by=8,
                             seq_length=seq_length, max_position_embeddings=seq_length,
                             position_embedding_type="rope", hidden_dropout=0.0,
                             attention_dropout=0.0, add_bias_linear=False)


def comm_bytes_formula(comm_type: str, cp: int, batch: int, seq_length: int, heads: int,
                       head_dim: int, layers: int, width: int = 4) -> Dict[str, int]:
    """Bytes one cp rank sends in one micro-batch's forward + backward, per counter."""
    if cp == 1:
        return {}
    x = batch * seq_length // cp * heads * head_dim * width * layers
    if comm_type == "p2p":
        return {"send": (cp - 1) * 2 * x + (cp - 1) * 2 * x + cp * 2 * x}
    if comm_type == "all_gather":
        return {"all_gather": 2 * (cp - 1) * 2 * x, "reduce_scatter": (cp - 1) * 2 * x}
    if comm_type == HIERARCHICAL:
        inner, outer = 2, cp // 2
        ring = comm_bytes_formula("p2p", outer, batch, seq_length * outer // cp, heads,
                                  head_dim, layers, width)
        return {"all_to_all": 2 * 4 * x * (inner - 1) // inner, **ring}
    return {"all_to_all": 2 * 4 * x * (cp - 1) // cp}


class _Held:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class HeldActivations:
    """Inside `with tracker.recording():` every tensor autograd saves is held weakly;
    `bytes()` sums the distinct non-parameter storages still held at the moment it is
    called (plus those of `extra` tensors), so it can be read at any point of a step
    (tests/test_plan_memory.py reads it after every pass of a pipeline schedule)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.holders: List[weakref.ref] = []

    def _pack(self, t: torch.Tensor) -> _Held:
        held = _Held(t)
        self.holders.append(weakref.ref(held))
        return held

    def recording(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def bytes(self, extra: Sequence[torch.Tensor] = ()) -> int:
        alive = [held.tensor for ref in self.holders if (held := ref()) is not None]
        storages: Dict[int, int] = {}
        for tensor in alive + list(extra):
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in self.params:
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())


def held_activation_bytes(model: torch.nn.Module, forward: Callable[[], Any]) -> Any:
    """(bytes of distinct non-parameter storages autograd keeps after `forward()`, its
    output): see the module docstring."""
    tracker = HeldActivations(model)
    with tracker.recording():
        output = forward()
    gc.collect()  # graphs kept only by reference cycles are not held
    return tracker.bytes(), output


def _one_rank(rank: int, cp: int, config: TransformerConfig, comm_type: str,
              batch: int) -> Dict[str, Any]:
    """This cp rank's held activation bytes, bytes sent by counter, and step seconds."""
    import torch.distributed as dist

    from gigatron.models.gpt import GPTModel
    from gigatron.parallel import comm
    from gigatron.parallel.context.split import split_for_rank

    torch.set_num_threads(1)
    group = dist.group.WORLD if cp > 1 else None
    if comm_type == HIERARCHICAL:
        from gigatron.parallel.topology import ProcessGroups, Topology

        group = ProcessGroups(Topology(cp=cp), rank, hierarchical_cp=(2, cp // 2)).cp_group
    model = GPTModel(config, cp_group=group, cp_comm_type=comm_type).train()
    ids = torch.randint(0, config.vocab_size, (batch, config.seq_length),
                        generator=torch.Generator().manual_seed(0))
    local = split_for_rank(ids, cp, rank, seq_dim=1)
    comm.stats.reset()
    start = time.perf_counter()
    held, loss = held_activation_bytes(model, lambda: model(input_ids=local, labels=local))
    loss.sum().backward()
    seconds = time.perf_counter() - start
    return {"activation_bytes": held, "bytes": comm.stats.snapshot(), "seconds": seconds}


def measure(cp: int, config: TransformerConfig, comm_type: str, batch: int = 1
            ) -> Dict[str, Any]:
    """One row: cp ranks' largest held activations and rank 0's bytes against the formula."""
    per_rank = run_on_ranks(_one_rank, cp, config, comm_type, batch, timeout=3600)
    formula = comm_bytes_formula(comm_type, cp, batch, config.seq_length,
                                 config.num_attention_heads, config.head_dim,
                                 config.num_layers)
    return {"seq_length": config.seq_length, "cp": cp, "comm_type": comm_type,
            "activation_bytes": max(r["activation_bytes"] for r in per_rank),
            "measured_bytes": per_rank[0]["bytes"], "formula_bytes": formula,
            "seconds": max(r["seconds"] for r in per_rank)}


def with_ratios(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each row's cp1-over-this activation ratio (same sequence length)."""
    base = {r["seq_length"]: r["activation_bytes"] for r in rows if r["cp"] == 1}
    for r in rows:
        r["ratio"] = base[r["seq_length"]] / r["activation_bytes"] if r["seq_length"] in base \
            else None
    return rows


def run(seq_lengths: Sequence[int], cps: Sequence[int], comm_types: Sequence[str],
        layers: int, batch: int) -> List[Dict[str, Any]]:
    """Every (sequence length, cp, comm type) row; cp 1 once per length."""
    rows = []
    for s in seq_lengths:
        config = tiny_config(s, layers)
        for cp in cps:
            for comm_type in (("p2p",) if cp == 1 else comm_types):
                rows.append(measure(cp, config, "p2p" if cp == 1 else comm_type, batch))
                if cp == 1:
                    rows[-1]["comm_type"] = "-"
    return with_ratios(rows)


def table(rows: List[Dict[str, Any]]) -> str:
    """A markdown table of the rows."""
    out = ["| seq | cp | comm type | activations/rank MiB | cp1 / this | bytes sent/rank "
           "(measured) | formula | fwd+bwd s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        measured = ", ".join(f"{k} {v:,}" for k, v in sorted(r["measured_bytes"].items()))
        formula = ", ".join(f"{k} {v:,}" for k, v in sorted(r["formula_bytes"].items()))
        out.append(f"| {r['seq_length']} | {r['cp']} | {r['comm_type']} | "
                   f"{r['activation_bytes'] / 2 ** 20:.1f} | {r['ratio']:.2f} | "
                   f"{measured or '-'} | {formula or '-'} | {r['seconds']:.2f} |")
    return "\n".join(out)


def problems(rows: List[Dict[str, Any]]) -> List[str]:
    """What breaks the claims: bytes off the formula, activations not ~1/cp."""
    out = []
    for r in rows:
        where = f"seq {r['seq_length']} cp {r['cp']} {r['comm_type']}"
        if r["measured_bytes"] != r["formula_bytes"]:
            out.append(f"{where}: sent {r['measured_bytes']}, formula {r['formula_bytes']}")
        if r["cp"] > 1 and abs(r["ratio"] / r["cp"] - 1) > TOLERANCE:
            out.append(f"{where}: activations fell {r['ratio']:.2f}x, not {r['cp']}x "
                       f"within {TOLERANCE:.0%}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Measure, print the table, write JSON; exit 1 when a claim fails."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--comm-types", nargs="+", default=list(COMM_TYPES),
                        choices=COMM_TYPES + (HIERARCHICAL,))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--out", default=None, help="folder for bench_context_parallel.json")
    opts = parser.parse_args(argv)
    if 1 not in opts.cp:
        parser.error("--cp must include 1 (the baseline of the ratios)")
    rows = run(opts.seq_lengths, opts.cp, opts.comm_types, opts.layers, opts.batch)
    print(table(rows))
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
        with open(os.path.join(opts.out, "bench_context_parallel.json"), "w") as f:
            json.dump({"torch": torch.__version__, "rows": rows}, f, indent=1)
    failed = problems(rows)
    for line in failed:
        print(f"FAIL {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
