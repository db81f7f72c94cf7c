"""Tensor parallelism for any model: `parallelize(model, plan, groups)`.

    plan = {"blocks.*.attn": LocalAttributes(divide=("n_heads",)),
            "blocks.*.attn.qkv": ColumnParallel(fused=3), "blocks.*.attn.out": "row",
            "blocks.*.mlp.up": "column", "blocks.*.mlp.down": "row",
            "embed": "vocab_embedding", "head": ColumnParallel(gather_output=True)}
    model = parallelize(model, plan, groups)      # groups: ProcessGroups or a tp group

The model is built (and loaded) whole, then each matched Linear/Embedding is swapped for
the existing Column/RowParallelLinear or VocabParallelEmbedding holding this tp rank's slice
of the module's own weights; tied weights stay tied. Ready-made plans: models/tensor_plans.py.

Patterns are shell-style (`fnmatch.fnmatchcase`, case-sensitive) over the full dotted names
of `model.named_modules()` ("" is the model itself); `*` matches any run of characters,
dots included, so "h.*.c_proj" names both GPT-2's attention and MLP output projections.
A style is a `Style` from styles.py or a shorthand string: column, row, vocab_embedding,
sequence_parallel_norm, replicate.

Everything is checked before the model changes, each problem as one line of one ValueError:
a pattern that matches nothing; two patterns matching one module with different styles;
a style on the wrong kind of module; a shape (output/input features, fused block, vocab,
head-count attribute) not divisible by tp; and "unmatched Linear layers under a pattern":
a Linear that no pattern names beside a layer the plan splits (same parent module) or inside
a module with LocalAttributes (an attention module whose heads are split) -- it would get
split activations while holding whole weights. Name it 'replicate' if that is meant. A
weight shared by a split module and an unsplit one is an error too (the tie would break).

Sequence parallelism (`TensorParallelPlan(sequence_parallel=True)`): between a row-parallel
layer and the next column-parallel one, activations stay split along dim 0 across tp --
Megatron's sequence parallelism for sequence-first [s, b, h] models; for batch-first
[b, s, h] models (Hugging Face's) dim 0 is the batch, equally exact because what runs there
(norms, dropout, residual adds, row biases) treats each token alone. Every column layer
all-gathers dim 0 of its input, every row layer reduce-scatters its output, the vocab
embedding reduce-scatters its output, and every replicated module with parameters in that
region (norms, a position table added there) must be named 'sequence_parallel_norm' so its
partial grads are summed over tp. dim 0 must be divisible by tp. The model's output is
whole when its last layer is column-parallel (it gathers dim 0); otherwise it is split.
Things that read dim 0 of split activations (an attention mask built from the embeddings'
batch size) are the model's business: see the plans' notes.

Pipelines: build the `gigatron.pipe.PipelineModule` (each rank holds its stage's layers),
then `parallelize(net, plan, net.groups)` before `gigatron.initialize`; patterns use its
names ("3.attn.qkv", "tied_modules.embed.tok") and may match nothing on some stages. A
module is swapped inside its parent; the stages read the PipelineModule's modules when the
engine is built, so a swapped top-level layer is the one that runs.

Modules between a column and a row layer must take their shapes from the column layer's
output, not from their own input (split under sequence parallelism).

Not done here: replicating key/value heads when tp exceeds them (num_key_value_heads must be
divisible by tp), and per-tp-rank dropout streams (dropout inside split regions draws from
the default generator, the same stream on every tp rank).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Dict, List, Mapping, Tuple, Union

import torch
from torch import nn

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.tensor.styles import (SHORTHANDS, LocalAttributes, ShardContext, Style,
                                             is_linear)
from gigatron.parallel.topology import ProcessGroups

StyleLike = Union[str, Style]


@dataclass
class TensorParallelPlan:
    """Module-name patterns -> styles, and whether the model runs sequence-parallel."""

    layers: Mapping[str, StyleLike] = field(default_factory=dict)
    sequence_parallel: bool = False

    def styles(self) -> Dict[str, Style]:
        """The entries with shorthands resolved; an unknown style is a ValueError."""
        out, bad = {}, []
        for pattern, style in self.layers.items():
            if isinstance(style, str) and style in SHORTHANDS:
                out[pattern] = SHORTHANDS[style]
            elif isinstance(style, Style):
                out[pattern] = style
            else:
                bad.append(f"plan entry {pattern!r}: unknown style {style!r}: use one of "
                           f"{', '.join(SHORTHANDS)} or a Style")
        if bad:
            raise ValueError("\n".join(bad))
        return out


PlanLike = Union[TensorParallelPlan, Mapping[str, StyleLike]]
Matches = Dict[str, Tuple[str, Style]]


def parallelize(model: nn.Module, plan: PlanLike,
                groups: Union[ProcessGroups, Group]) -> nn.Module:
    """Split `model` in place over the tp group (`groups.tp`, or `groups` itself) by `plan`;
    returns the model. Every tp rank calls it on the same whole model. With a ProcessGroups
    of several pipeline stages, each stage splits the modules it holds, and a pattern is
    an error only if it matches nothing on every stage (every pp rank must call it)."""
    plan = plan if isinstance(plan, TensorParallelPlan) else TensorParallelPlan(dict(plan))
    tp_group = groups.tp if isinstance(groups, ProcessGroups) else groups
    ctx = ShardContext(tp_group, plan.sequence_parallel)
    pp_group = groups.pp if isinstance(groups, ProcessGroups) and groups.size("pp") > 1 \
        else None
    matches = match_plan(model, plan, pp_group)
    modules = dict(model.named_modules())
    label = {name: name or type(model).__name__ for name in matches}  # "" is the model
    problems = [p for name, (_, style) in matches.items()
                for p in style.check(modules[name], label[name], ctx)]
    problems += unmatched_linears(modules, matches) + broken_ties(modules, matches)
    if problems:
        raise ValueError("\n".join(problems))
    for name, (_, style) in matches.items():
        new = style.apply(modules[name], label[name], ctx)
        if new is not modules[name]:
            if not name:
                return new
            parent, _, child = name.rpartition(".")
            setattr(modules[parent], child, new)
    return model


def match_plan(model: nn.Module, plan: TensorParallelPlan, pp_group: Group = None) -> Matches:
    """Module name -> (pattern, style); patterns matching nothing (on any stage of
    `pp_group`) and conflicting patterns are a ValueError (all of them, one line each)."""
    styles = plan.styles()
    names = [name for name, _ in model.named_modules()]
    matched: Matches = {}
    conflicts: Dict[Tuple[str, str], List[str]] = {}
    hits = []
    for pattern, style in styles.items():
        found = [n for n in names if fnmatchcase(n, pattern)]
        hits.append(len(found))
        for name in found:
            if name not in matched:
                matched[name] = (pattern, style)
            elif matched[name][1] != style:
                conflicts.setdefault((matched[name][0], pattern), []).append(name)
    where = f"any pipeline stage of {type(model).__name__}" if pp_group is not None \
        else type(model).__name__
    problems = [f"plan pattern {pattern!r} matches no module of {where}"
                for pattern, n in zip(styles, _hits_on_any_stage(model, hits, pp_group)) if not n]
    for (first, second), names_hit in conflicts.items():
        more = f" (and {len(names_hit) - 1} more)" if len(names_hit) > 1 else ""
        problems.append(f"conflicting patterns: {first!r} ({styles[first].name}) and "
                        f"{second!r} ({styles[second].name}) both match "
                        f"{names_hit[0]!r}{more}")
    if problems:
        raise ValueError("\n".join(problems))
    return {n: matched[n] for n in names if n in matched}  # model order


def _hits_on_any_stage(model: nn.Module, hits: List[int], pp_group: Group) -> List[int]:
    """Matches per pattern summed over the pipeline stages (the plan is the same on all)."""
    if pp_group is None or not hits:
        return hits
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    total = torch.tensor(hits, dtype=torch.int64, device=device)
    comm.all_reduce(total, group=pp_group)
    return [int(n) for n in total.tolist()]


def _children(modules: Mapping[str, nn.Module], scope: str, deep: bool) -> List[str]:
    prefix = f"{scope}." if scope else ""
    return [n for n in modules if n.startswith(prefix) and n != scope
            and (deep or "." not in n[len(prefix):])]


def unmatched_linears(modules: Mapping[str, nn.Module], matches: Matches) -> List[str]:
    """Linear layers no pattern names beside a split layer or inside a LocalAttributes
    module: each named once, one line per pattern that first put it in scope."""
    first_pattern: Dict[str, str] = {}
    for name, (pattern, style) in matches.items():
        if isinstance(style, LocalAttributes):
            scope, deep = name, True
        elif style.replaces():
            scope, deep = name.rpartition(".")[0], False
        else:
            continue
        for child in _children(modules, scope, deep):
            if is_linear(modules[child]) and child not in matches:
                first_pattern.setdefault(child, pattern)
    by_pattern: Dict[str, List[str]] = {}
    for child in modules:
        if child in first_pattern:
            by_pattern.setdefault(first_pattern[child], []).append(child)
    return [f"unmatched Linear layers under a pattern: {found[:3]}"
            f"{f' (and {len(found) - 3} more)' if len(found) > 3 else ''} sit beside or "
            f"inside modules that {pattern!r} splits but match no pattern: give them a style "
            f"('replicate' keeps one whole)" for pattern, found in by_pattern.items()]


def broken_ties(modules: Mapping[str, nn.Module], matches: Matches) -> List[str]:
    """Parameters shared by a module the plan re-makes and one it keeps as is."""
    remade: Dict[int, str] = {}
    for name, (_, style) in matches.items():
        if style.replaces():
            remade.update({id(p): name for p in modules[name].parameters(recurse=False)})
    problems = []
    for name, module in modules.items():
        if name in matches and matches[name][1].replaces():
            continue
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in remade:
                problems.append(f"{name}.{pname} is shared (tied) with {remade[id(p)]!r}, "
                                f"which the plan splits: give {name!r} a matching style too")
    return problems
