"""How a `PipelineModule`'s list of layers is cut into pipeline stages, DeepSpeed's way.

`partition_method` takes DeepSpeed's values and meanings (deepspeed/runtime/pipe/module.py
and runtime/utils.py, read at deepspeedai/DeepSpeed master, 2025):

- "uniform": equal layer counts; when they do not divide, the first stages get one more;
- "parameters" (DeepSpeed's default): balance the trainable parameter counts per layer;
- "type:<regex>": balance the number of layers whose class name matches the regex
  (case-insensitive search), e.g. "type:TransformerBlock".

Balancing is DeepSpeed's dynamic programme over prefixes: cutting the first i layers into j
stages keeps the split whose stages' (heaviest - lightest) weight is smallest (on ties the
latest cut), and extends it one stage at a time. It is not a global optimum; it is what
DeepSpeed computes, so a model moved from DeepSpeed keeps its stages.

A partition is a list `parts` of num_parts + 1 layer indices: stage s builds layers
parts[s] .. parts[s+1]-1. Unlike DeepSpeed, a stage with no layer is an error here.
Pure: no torch, no processes.
"""
from __future__ import annotations

import itertools
import re
from typing import Dict, List, Optional, Sequence

from gigatron.parallel.pipeline.schedules import stage_position

METHODS = ("parameters", "uniform", "type:<regex>")


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """Equal counts, the first `num_items % num_parts` parts one larger (DeepSpeed's
    partition_uniform; with fewer items than parts, the last parts are empty)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[float], num_parts: int) -> List[int]:
    """DeepSpeed's partition_balanced: per (items, parts) prefix, the split with the smallest
    spread between its heaviest and lightest part, extended part by part."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    prefix = [0.0] + list(itertools.accumulate(float(w) for w in weights))
    inf = float("inf")
    # best[i][j] = (spread, heaviest, lightest, cut) for the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (m + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            current = best[i][j]
            for k in range(i):
                _, heaviest, lightest, _ = best[k][j - 1]
                part = prefix[i] - prefix[k]
                high, low = max(heaviest, part), min(lightest, part)
                spread = high - low
                if current[0] >= spread:  # '>=': a later cut wins a tie
                    current = (spread, high, low, k)
            best[i][j] = current
    parts = [n]
    for j in range(m, 0, -1):
        parts.append(best[parts[-1]][j][3])
    return parts[::-1]


def type_weights(method: str, type_names: Sequence[Optional[str]]) -> List[int]:
    """1 for each layer whose type name matches "type:<regex>" (case-insensitive), else 0."""
    pattern = method.split(":", 1)[1]
    try:
        regex = re.compile(pattern, re.IGNORECASE)
    except re.error as err:
        raise ValueError(f"partition_method={method!r}: {pattern!r} is not a valid regular "
                         f"expression ({err})") from None
    weights = [int(name is not None and regex.search(name) is not None) for name in type_names]
    if not any(weights):
        names = sorted({n for n in type_names if n is not None})
        raise ValueError(f"partition_method={method!r} matches no layer: the layer types are "
                         f"{', '.join(names)}")
    return weights


def partition_by_method(method: str, param_counts: Sequence[int],
                        type_names: Sequence[Optional[str]], num_parts: int) -> List[int]:
    """The stage boundaries for `method` over layers with these trainable parameter counts
    and class names (None for a layer without one); every part gets at least one layer."""
    if not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"the number of pipeline stages must be a positive integer, got "
                         f"{num_parts!r}")
    num_layers = len(param_counts)
    if num_layers < num_parts:
        raise ValueError(f"{num_layers} layer{'s' if num_layers != 1 else ''} cannot fill "
                         f"{num_parts} pipeline stages: every stage needs at least one layer; "
                         f"use fewer stages (num_stages / virtual_stages) or more layers")
    if not isinstance(method, str):
        raise ValueError(f"partition_method must be a string, one of {', '.join(METHODS)}; "
                         f"got {method!r}")
    lowered = method.lower()  # DeepSpeed lower-cases the whole method, regex included
    if lowered == "uniform":
        return partition_uniform(num_layers, num_parts)
    if lowered == "parameters":
        return partition_balanced(list(param_counts), num_parts)
    if lowered.startswith("type:"):
        return partition_balanced(type_weights(lowered, type_names), num_parts)
    raise ValueError(f"partition_method={method!r} is not one of {', '.join(METHODS)} "
                     f"(DeepSpeed's 'profile' is not implemented there either)")


def stage_of_layer(parts: Sequence[int], layer: int) -> int:
    """The (virtual) stage that builds `layer`."""
    for stage in range(len(parts) - 1):
        if parts[stage] <= layer < parts[stage + 1]:
            return stage
    raise ValueError(f"layer {layer} is outside the partition {list(parts)}")


def describe_partition(parts: Sequence[int], names: Sequence[str], param_counts: Sequence[int],
                       pp_size: int, placement: str = "loop") -> str:
    """One block per virtual stage: where it runs (`placement`: schedules.placement_of), its
    layers and parameter counts."""
    lines = []
    virtual = (len(parts) - 1) // pp_size
    for stage in range(len(parts) - 1):
        start, stop = parts[stage], parts[stage + 1]
        rank, chunk = stage_position(stage, pp_size, placement)
        where = f"pipeline stage {rank}" + (f", chunk {chunk}" if virtual > 1 else "")
        total = sum(param_counts[start:stop])
        lines.append(f"stage {stage} ({where}): layers {start}-{stop - 1}, "
                     f"{total:,} parameters")
        lines += [f"    {i:3d}: {names[i]} ({param_counts[i]:,})" for i in range(start, stop)]
    return "\n".join(lines)


def tied_stages(keys: Sequence[Optional[str]], parts: Sequence[int]) -> Dict[str, List[int]]:
    """{tie key: the virtual stages holding a layer with it} for layers' keys (None: untied).

    A key may live on one stage (its layers share one module there) or on the first and the
    last (tied input/output embeddings: their gradients are summed over the two); any other
    spread is refused: ZeRO sums tied gradients over the first and last stage only."""
    stages: Dict[str, List[int]] = {}
    for layer, key in enumerate(keys):
        if key is not None:
            stage = stage_of_layer(parts, layer)
            if stage not in stages.setdefault(key, []):
                stages[key].append(stage)
    last = len(parts) - 2
    for key, held in stages.items():
        if len(held) > 1 and held != [0, last]:
            raise ValueError(
                f"TiedLayerSpec key {key!r} lands on virtual stages {held} of 0..{last}: a "
                f"tied module may be used on one stage, or on the first and the last (tied "
                f"embeddings); change the partition or the number of stages")
    return stages
