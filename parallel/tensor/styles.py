"""Styles of a tensor-parallel plan: what `parallelize` does to each module a pattern names.

Each style first checks a module (every problem as one line, before anything changes), then
applies itself: the splitting styles build the existing tensor-parallel layer and copy in
this rank's slice of the module's own weights, so a loaded (pretrained) model is split as is.

  ColumnParallel   "column"                 Linear -> ColumnParallelLinear (rows of W split)
  RowParallel      "row"                    Linear -> RowParallelLinear (columns of W split)
  VocabParallel    "vocab_embedding"        Embedding -> VocabParallelEmbedding (vocab rows)
  SequenceParallelNorm "sequence_parallel_norm"  kept whole; runs on dim-0-split activations
  Replicate        "replicate"              kept whole on every rank
  LocalAttributes  (no shorthand)           divides head counts etc. by tp; sets tp groups

"Linear" means torch's nn.Linear, Hugging Face's Conv1D (GPT-2; weight stored [in, out],
transposed here) or an unsplit (tp=1) Column/RowParallelLinear (gigatron's own models).
A model's own fix-ups (anything a module computes from its local width) are a subclass of
`Style` with its own `check` and `apply`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
from torch import nn

from gigatron.parallel.comm import Group
from gigatron.parallel.tensor.init import Stride, shard
from gigatron.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear,
                                             VocabParallelEmbedding)
from gigatron.parallel.tensor.mappings import tp_rank, tp_size


@dataclass
class ShardContext:
    """The tp group and the plan's mode while one model is split, plus the shards made so
    far: a weight shared by two modules (tied embeddings) gets one shared shard."""

    tp_group: Group
    sequence_parallel: bool = False
    shards: Dict[int, Tuple[tuple, nn.Parameter]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return tp_size(self.tp_group)

    @property
    def rank(self) -> int:
        return tp_rank(self.tp_group)


class Style:
    """Base of the styles. Subclass it for a model's own fix-ups (see LocalAttributes)."""

    name = "style"

    def check(self, module: nn.Module, name: str, ctx: ShardContext) -> List[str]:
        """Every reason this style cannot treat `module` (one line each); [] if it can."""
        return []

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        """The module to put in `module`'s place (`module` itself when changed in place)."""
        return module

    def replaces(self) -> bool:
        """Whether `apply` swaps the module for a new one (its parameters are re-made)."""
        return False


@dataclass
class _Dense:
    """A Linear-like layer seen as y = x W^T + b with W [out, in]."""

    weight: Optional[nn.Parameter]  # as stored (None: a tied output layer without its own)
    transposed: bool  # stored [in, out] (Hugging Face Conv1D)
    bias: Optional[nn.Parameter]
    in_features: int
    out_features: int


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a Linear whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def is_linear(module: nn.Module) -> bool:
    """Any Linear-like layer, split or not (what the plan must account for)."""
    return isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) \
        or is_conv1d(module)


def _dense(module: Any) -> Optional[_Dense]:
    """The unsplit Linear-like view of `module`, or None if it is not one (typed Any: the
    attributes read depend on which layer it is)."""
    if isinstance(module, nn.Linear):
        return _Dense(cast(nn.Parameter, module.weight), False, module.bias,
                      module.in_features, module.out_features)
    if is_conv1d(module):
        w = module.weight
        return _Dense(w, True, module.bias, w.shape[0], w.shape[1])
    if isinstance(module, ColumnParallelLinear) and tp_size(module.tp_group) == 1:
        w = module.weight
        return _Dense(w, False, module.bias, 0 if w is None else w.shape[1],
                      module.output_size_per_partition)
    if isinstance(module, RowParallelLinear) and tp_size(module.tp_group) == 1:
        return _Dense(module.weight, False, module.bias, module.weight.shape[1],
                      module.weight.shape[0])
    return None


def _wrong_module(name: str, module: nn.Module, style: str, wanted: str) -> str:
    already = isinstance(module, (ColumnParallelLinear, RowParallelLinear,
                                  VocabParallelEmbedding)) and tp_size(module.tp_group) > 1
    why = "is already split across tp: parallelize splits unsplit (tp=1) models" if already \
        else f"is a {type(module).__name__}"
    return f"{name}: style {style!r} needs {wanted}, but the module {why}"


def _not_divisible(name: str, what: str, size: int, tp: int) -> List[str]:
    if size % tp:
        return [f"{name}: {what} {size} is not divisible by tp={tp}"]
    return []


def _like(d: _Dense) -> Tuple[torch.dtype, torch.device]:
    ref = d.weight if d.weight is not None else d.bias
    if ref is None:
        return torch.get_default_dtype(), torch.device("cpu")
    return ref.dtype, ref.device


def _load(new: nn.Module, attr: str, source: Optional[nn.Parameter], transposed: bool,
          dim: Optional[int], stride: Stride, ctx: ShardContext, name: str) -> None:
    """Fill `new.<attr>` with this rank's slice of `source` (split along `dim` of the
    Linear layout; None = replicated), or reuse the shard made for a module sharing it."""
    if source is None:
        return
    layout = (transposed, dim, stride)
    if id(source) in ctx.shards:
        made_layout, made = ctx.shards[id(source)]
        if made_layout != layout:
            raise ValueError(f"{name}.{attr} is shared (tied) with a module split another "
                             f"way: tied weights need the same split (e.g. vocab_embedding "
                             f"and a column output layer), got {made_layout} and {layout}")
        setattr(new, attr, made)
        return
    target: nn.Parameter = getattr(new, attr)
    full = source.detach().t() if transposed else source.detach()
    if not (target.is_meta or full.is_meta):
        part = full if dim is None else shard(full, dim, ctx.rank, ctx.size, stride)
        with torch.no_grad():
            target.copy_(part)
    target.requires_grad_(source.requires_grad)
    if getattr(source, "shared_embedding", False):
        setattr(target, "shared_embedding", True)  # pipeline-tied copies keep their tag
    ctx.shards[id(source)] = (layout, target)


@dataclass(frozen=True)
class ColumnParallel(Style):
    """Split a Linear's output features: each rank computes its slice of y.

    `gather_output` all-gathers y (the full output for a replicated consumer, e.g. logits
    for a loss that expects them whole). `fused` says y stacks blocks that must each be split
    (a fused q, k, v): an int for equal blocks, or a tuple of the blocks' sizes."""

    gather_output: bool = False
    fused: Stride = 1
    name = "column"

    def _block_sizes(self, out_features: int) -> Tuple[int, ...]:
        if isinstance(self.fused, int):
            return (out_features // self.fused,) * self.fused
        return tuple(self.fused)

    def check(self, module: nn.Module, name: str, ctx: ShardContext) -> List[str]:
        d = _dense(module)
        if d is None:
            return [_wrong_module(name, module, self.name, "a Linear")]
        uneven = d.out_features % self.fused if isinstance(self.fused, int) else \
            sum(self.fused) != d.out_features
        if uneven:
            return [f"{name}: fused={self.fused} does not add up to the output features "
                    f"{d.out_features}"]
        sizes = self._block_sizes(d.out_features)
        return [p for i, size in enumerate(sizes) for p in _not_divisible(
            name, "output features" if len(sizes) == 1 else f"fused block {i} of output",
            size, ctx.size)]

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        d = _dense(module)
        assert d is not None, "check() accepted it"
        dtype, device = _like(d)
        new = ColumnParallelLinear(d.in_features, d.out_features, tp_group=ctx.tp_group,
                                   bias=d.bias is not None, gather_output=self.gather_output,
                                   sequence_parallel=ctx.sequence_parallel,
                                   skip_weight_param=d.weight is None,
                                   partition_stride=self.fused, params_dtype=dtype,
                                   device=device)
        _load(new, "weight", d.weight, d.transposed, 0, self.fused, ctx, name)
        _load(new, "bias", d.bias, False, 0, self.fused, ctx, name)
        return new

    def replaces(self) -> bool:
        return True


@dataclass(frozen=True)
class RowParallel(Style):
    """Split a Linear's input features; partial results are summed over tp (a reduce-scatter
    along dim 0 under sequence parallelism). `input_is_parallel=False` splits a whole input
    first. The bias stays whole and is added once, after the sum."""

    input_is_parallel: bool = True
    name = "row"

    def check(self, module: nn.Module, name: str, ctx: ShardContext) -> List[str]:
        d = _dense(module)
        if d is None:
            return [_wrong_module(name, module, self.name, "a Linear")]
        if ctx.sequence_parallel and not self.input_is_parallel:
            return [f"{name}: row style with input_is_parallel=False cannot run under "
                    f"sequence parallelism"]
        return _not_divisible(name, "input features", d.in_features, ctx.size)

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        d = _dense(module)
        assert d is not None and d.weight is not None, "check() accepted it"
        dtype, device = _like(d)
        new = RowParallelLinear(d.in_features, d.out_features, tp_group=ctx.tp_group,
                                bias=d.bias is not None,
                                input_is_parallel=self.input_is_parallel,
                                sequence_parallel=ctx.sequence_parallel, params_dtype=dtype,
                                device=device)
        _load(new, "weight", d.weight, d.transposed, 1, 1, ctx, name)
        _load(new, "bias", d.bias, False, None, 1, ctx, name)
        return new

    def replaces(self) -> bool:
        return True


def _embedding_problems(module: nn.Module, name: str) -> List[str]:
    if isinstance(module, VocabParallelEmbedding):
        return [] if tp_size(module.tp_group) == 1 else \
            [_wrong_module(name, module, "vocab_embedding", "an Embedding")]
    if not isinstance(module, nn.Embedding):
        return [_wrong_module(name, module, "vocab_embedding", "an Embedding")]
    unsupported = [k for k in ("max_norm", "scale_grad_by_freq", "sparse") if getattr(module, k)]
    return [f"{name}: vocab_embedding does not support nn.Embedding's {k}" for k in unsupported]


@dataclass(frozen=True)
class VocabParallel(Style):
    """Split an embedding table by vocab rows; ids of other ranks' rows look up zeros and
    the partial embeddings are summed (reduce-scattered along dim 0 under sequence
    parallelism, in the model's own layout). A padding_idx row keeps getting no grad."""

    name = "vocab_embedding"

    def check(self, module: nn.Module, name: str, ctx: ShardContext) -> List[str]:
        problems = _embedding_problems(module, name)
        if problems:
            return problems
        rows = cast(torch.Tensor, module.weight).shape[0]
        if rows % ctx.size:
            return [f"{name}: vocab size (embedding rows) {rows} is not divisible by "
                    f"tp={ctx.size}: pad it (Hugging Face: "
                    f"resize_token_embeddings(pad_to_multiple_of={ctx.size}))"]
        return []

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        weight = cast(nn.Parameter, module.weight)
        rows, dim = weight.shape
        new = VocabParallelEmbedding(rows, dim, tp_group=ctx.tp_group,
                                     reduce_scatter_embeddings=ctx.sequence_parallel,
                                     keep_layout=True, params_dtype=weight.dtype,
                                     device=weight.device)
        _load(new, "weight", weight, False, 0, 1, ctx, name)
        padding_idx = getattr(module, "padding_idx", None)
        if padding_idx is not None and new.vocab_start <= padding_idx < new.vocab_end:
            local = torch.tensor([padding_idx - new.vocab_start], device=weight.device)
            new.weight.register_hook(lambda g: g.index_fill(0, local, 0.0))
        return new

    def replaces(self) -> bool:
        return True


@dataclass(frozen=True)
class SequenceParallelNorm(Style):
    """A replicated module (norm; also e.g. a position table added there) that runs on
    activations split along dim 0 across tp: each rank sees only its part of the tokens, so
    its parameters are tagged `sequence_parallel` and their grads summed over tp (ZeRO does
    it; without ZeRO call `allreduce_sequence_parallel_grads`). Needs sequence_parallel=True."""

    name = "sequence_parallel_norm"

    def check(self, module: nn.Module, name: str, ctx: ShardContext) -> List[str]:
        if not ctx.sequence_parallel:
            return [f"{name}: style 'sequence_parallel_norm' needs a plan with "
                    f"sequence_parallel=True (use 'replicate' without it)"]
        inner = [n for n, m in module.named_modules() if is_linear(m)]
        if inner:
            return [f"{name}: style 'sequence_parallel_norm' is for norms and other small "
                    f"replicated modules, but it holds Linear layers {inner[:3]}"]
        return []

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        for p in module.parameters():
            setattr(p, "sequence_parallel", True)
        return module


@dataclass(frozen=True)
class Replicate(Style):
    """Keep the module whole on every rank (names a Linear the plan leaves unsplit on
    purpose). Under sequence parallelism use sequence_parallel_norm for modules that see
    split activations."""

    name = "replicate"


@dataclass(frozen=True)
class LocalAttributes(Style):
    """The hook for what a module computes from its own width: divide the integer
    attributes `divide` by tp (head counts of an attention module: Hugging Face's
    `num_heads`/`num_key_value_heads`/`hidden_size`, GPT-2's `split_size`) and set the
    attributes `tp_group` to the tp group. Missing attributes are errors unless
    `missing_ok` (plans covering several library versions)."""

    divide: Tuple[str, ...] = ()
    tp_group: Tuple[str, ...] = ()
    missing_ok: bool = False
    name = "local_attributes"

    def check(self, module: nn.Module, name: str, ctx: ShardContext) -> List[str]:
        problems = []
        for attr in tuple(self.divide) + tuple(self.tp_group):
            if not hasattr(module, attr) and not self.missing_ok:
                problems.append(f"{name}: has no attribute {attr!r} to make tensor-parallel")
        for attr in self.divide:
            value = getattr(module, attr, None)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                problems.append(f"{name}.{attr} is {value!r}, not an integer to divide by tp")
            else:
                problems += _not_divisible(name, f"attribute {attr}", value, ctx.size)
        return problems

    def apply(self, module: nn.Module, name: str, ctx: ShardContext) -> nn.Module:
        for attr in self.divide:
            if getattr(module, attr, None) is not None:
                setattr(module, attr, getattr(module, attr) // ctx.size)
        for attr in self.tp_group:
            if hasattr(module, attr):
                setattr(module, attr, ctx.tp_group)
        return module


SHORTHANDS: Dict[str, Style] = {
    "column": ColumnParallel(), "row": RowParallel(), "vocab_embedding": VocabParallel(),
    "sequence_parallel_norm": SequenceParallelNorm(), "replicate": Replicate(),
}
