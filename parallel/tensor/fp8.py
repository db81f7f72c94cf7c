"""FP8 training of the tensor-parallel linears: Megatron's --fp8-format and --fp8-recipe.

Megatron-Core with `--fp8-format` runs the GEMMs of its transformer layers (linear_qkv,
linear_proj, linear_fc1, linear_fc2; not the embedding, not the output layer, not core
attention) through Transformer Engine in FP8. Here the three GEMMs of each such linear --
fprop (x W^T), dgrad (g W) and wgrad (g^T x) -- run as FP8 GEMMs through `torch._scaled_mm`
(`fp8_gemm`), with the scales of the recipe (docs/FP8.md):

* Formats: activations and weights in E4M3 (max 448); output-gradients in E5M2 (max 57344)
  with `hybrid`, in E4M3 with `e4m3`. Quantising is saturate(x * scale) cast to FP8 (round
  to nearest even); `_scaled_mm` multiplies by the inverse scales. The FP8 operands, not
  the inputs, are kept for backward; `wgrad=False` (--no-fp8-wgrad, delayed only) keeps x.
* delayed (TE's DelayedScaling): each operand's amax joins the current row of an amax
  history; at the end of every forward of a model chunk (TE: leaving fp8_autocast) and of
  its backward, the current amaxes of all layers are MAX-reduced over the amax group (the
  stage's tensor-, context- and data-parallel ranks) in one all-reduce, the amax is the
  history's `max` or `most_recent` row, the history rolls and the next scale is
  fp8_max / amax / 2**margin (kept when the amax is 0 or not finite). The first step runs
  with scale 1, as TE does.
* tensorwise (TE's Float8CurrentScaling): each operand is quantised with its own amax,
  MAX-reduced over the state's `current_amax_group` (tp x cp) so a shard is quantised as
  the whole tensor is on one rank.
* blockwise (TE's Float8BlockScaling, DeepSeek-V3): power-of-two scales per 1x128 tile of
  activations and output-gradients (along each GEMM's K: x's rows for fprop, x^T's for
  wgrad) and per 128x128 tile of weights.
* Activation recomputation (parallel/tensor/random.checkpoint): as TE, the recomputed
  forward quantises with the delayed scales its original forward used and records no amax
  (`recording` / `replaying`); current and blockwise scales follow from the same input.
* --fp8-param-gather (parallel/zero/fp8_gather.py): the distributed optimizer publishes the
  weight in FP8 (`FP8LinearState.param_fp8`) and the forward uses it as it is, quantising
  only x (delayed scaling records the published weight's amax, as TE's optimizer cast does).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Deque, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from gigatron.parallel import comm
from gigatron.parallel.comm import Group
from gigatron.parallel.tensor.fp8_gemm import (E4M3, E5M2, FP8Operand, current_scale, fp8_gemm,
                                               fp8_max, quantize_1x128, quantize_128x128,
                                               quantize_tensorwise)
from gigatron.parallel.tensor.fp8_gemm import cast as quantize

FORMATS = ("e4m3", "hybrid")
SCALINGS = ("delayed", "tensorwise", "blockwise")  # Megatron's --fp8-recipe choices done here
AMAX_COMPUTE_ALGOS = ("max", "most_recent")


@dataclass(frozen=True)
class FP8Recipe:
    """Transformer Engine's FP8 recipe as Megatron-Core builds it from its flags: delayed
    (DelayedScaling), tensorwise (Float8CurrentScaling) or blockwise (Float8BlockScaling).
    margin and the amax history are delayed scaling's."""

    format: str = "hybrid"  # e4m3: E4M3 everywhere; hybrid: E5M2 for output-gradients
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True  # the weight-gradient GEMM in FP8 (False: in the run's precision)
    scaling: str = "delayed"

    def __post_init__(self) -> None:
        problems = [msg for ok, msg in (
            (self.format in FORMATS, f"format must be one of {FORMATS}, got {self.format!r}"),
            (self.scaling in SCALINGS,
             f"scaling must be one of {SCALINGS}, got {self.scaling!r}"),
            (self.amax_history_len >= 1,
             f"amax_history_len must be >= 1, got {self.amax_history_len}"),
            (self.amax_compute_algo in AMAX_COMPUTE_ALGOS,
             f"amax_compute_algo must be one of {AMAX_COMPUTE_ALGOS}, got "
             f"{self.amax_compute_algo!r}")) if not ok]
        if problems:
            raise ValueError("FP8Recipe: " + "; ".join(problems))

    @property
    def forward_dtype(self) -> torch.dtype:
        """Activations and weights."""
        return E4M3

    @property
    def backward_dtype(self) -> torch.dtype:
        """Output-gradients."""
        return E5M2 if self.format == "hybrid" else E4M3


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q / scale in `dtype`."""
    return (q.float() / scale).to(dtype)


def fake_quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded through FP8 `dtype` with `scale`, back in x's dtype."""
    return dequantize(quantize(x, scale, dtype), scale, x.dtype)


def amax(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of x, as an fp32 scalar (0 for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().max().float()


def scale_from_amax(amax_value: torch.Tensor, scale: torch.Tensor, top: float,
                    margin: int) -> torch.Tensor:
    """TE's scale update: top / amax / 2**margin; the old scale where amax is 0 or not
    finite; fp32's max where the quotient overflows."""
    new = (top / amax_value) / (2.0 ** margin)
    new = torch.where(amax_value > 0.0, new, scale)
    new = torch.where(torch.isfinite(amax_value), new, scale)
    return torch.where(torch.isinf(new), torch.full_like(new, torch.finfo(torch.float32).max),
                       new)


class ScalingMeta:
    """The amax history [len, n] and scales [n] of n FP8 operands (TE's fp8_meta).

    Row 0 is the current step's amax, written as operands are quantised; rows 1.. hold the
    previous steps' in a ring (oldest first), which `update` rolls."""

    def __init__(self, n: int, dtype: torch.dtype, recipe: FP8Recipe,
                 device: Optional[torch.device] = None) -> None:
        self.dtype, self.recipe = dtype, recipe
        self.amax_history = torch.zeros(recipe.amax_history_len, n, device=device)
        self.scale = torch.ones(n, device=device)

    def record_amax(self, i: int, x: torch.Tensor) -> None:
        """Operand i of this step: its amax joins the current row."""
        row = self.amax_history[0]
        row[i] = torch.maximum(row[i], amax(x))

    def quantize(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Operand i of this step: its amax recorded, quantised with the scale the history
        gave (delayed scaling)."""
        self.record_amax(i, x)
        return quantize(x, self.scale[i], self.dtype)

    def update(self) -> None:
        """After the current row was reduced over the amax group: the next scales, and the
        history rolled with a fresh current row (TE's amax-and-scale update)."""
        history = self.amax_history
        if self.recipe.amax_compute_algo == "max":
            current = history.max(dim=0).values
        else:
            current = history[0].clone()
        if history.shape[0] > 1:
            history.copy_(torch.roll(history, -1, 0))
        history[0].zero_()
        self.scale.copy_(scale_from_amax(current, self.scale, fp8_max(self.dtype),
                                         self.recipe.margin))


@dataclass
class FP8Weight:
    """A weight published in FP8 by the distributed optimizer (--fp8-param-gather): its
    bytes and factors as the recipe quantises the weight, the scale delayed scaling used and
    the weight's amax (MAX over its shards), which delayed scaling records in each forward."""

    operand: FP8Operand
    scale: torch.Tensor
    amax: torch.Tensor


class FP8LinearState:
    """The FP8 state of one linear layer: forward meta (input, weight), backward meta
    (output-gradient) of delayed scaling; tensorwise scaling's amax group (the ranks whose
    amaxes every current amax is MAX-reduced over, so that a tensor split over them is
    quantised as the whole tensor); the weight in FP8 when the optimizer published it."""

    INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 0

    def __init__(self, recipe: FP8Recipe, device: Optional[torch.device] = None,
                 current_amax_group: Group = None) -> None:
        self.recipe = recipe
        self.current_amax_group = current_amax_group
        self.forward = ScalingMeta(2, recipe.forward_dtype, recipe, device)
        self.backward = ScalingMeta(1, recipe.backward_dtype, recipe, device)
        self.param_fp8: Optional[FP8Weight] = None  # --fp8-param-gather's current weight


Scales = Tuple[torch.Tensor, torch.Tensor]
_RECORDINGS: List[List[Scales]] = []  # open recordings: forwards that will be recomputed
_REPLAYS: List[Deque[Scales]] = []  # open replays: recomputations, innermost last


@contextlib.contextmanager
def recording(store: List[Scales]) -> Iterator[None]:
    """Inside: each FP8 linear's forward appends the (input, weight) scales it used."""
    _RECORDINGS.append(store)
    try:
        yield
    finally:
        _RECORDINGS.pop()


@contextlib.contextmanager
def replaying(store: List[Scales]) -> Iterator[None]:
    """Inside: FP8 linears quantise with `store`'s scales, in the order recorded, and
    record no amax (TE's recomputation with the original forward's FP8 meta)."""
    _REPLAYS.append(collections.deque(store))
    try:
        yield
    finally:
        _REPLAYS.pop()


def _delayed_operands(x2d: torch.Tensor, weight: torch.Tensor,
                      state: FP8LinearState) -> Tuple[FP8Operand, FP8Operand]:
    """x and the weight in FP8 with the delayed scales of this forward (recorded for a
    recomputation, or replayed in one)."""
    meta, published = state.forward, state.param_fp8
    if _REPLAYS and _REPLAYS[-1]:
        x_scale, w_scale = _REPLAYS[-1].popleft()
    else:
        x_scale = meta.scale[state.INPUT].clone()
        w_scale = meta.scale[state.WEIGHT].clone() if published is None else published.scale
        meta.record_amax(state.INPUT, x2d)
        meta.record_amax(state.WEIGHT, weight if published is None else published.amax)
    for store in _RECORDINGS:
        store.append((x_scale, w_scale))
    w_fp8 = (quantize_tensorwise(weight, w_scale, meta.dtype) if published is None
             else published.operand)
    return quantize_tensorwise(x2d, x_scale, meta.dtype), w_fp8


def _current(x2d: torch.Tensor, dtype: torch.dtype, state: FP8LinearState) -> FP8Operand:
    """x2d in FP8 with its own amax, MAX-reduced over the state's group (tensorwise)."""
    top = amax(x2d)
    comm.all_reduce(top, state.current_amax_group, op=comm.ReduceOp.MAX)
    return quantize_tensorwise(x2d, current_scale(top, dtype), dtype)


def _forward_operands(x2d: torch.Tensor, weight: torch.Tensor,
                      state: FP8LinearState) -> Tuple[FP8Operand, FP8Operand]:
    """The fprop GEMM's FP8 operands under the state's recipe."""
    recipe, published = state.recipe, state.param_fp8
    if recipe.scaling == "delayed":
        return _delayed_operands(x2d, weight, state)
    if recipe.scaling == "tensorwise":
        return _current(x2d, E4M3, state), (_current(weight, E4M3, state) if published is None
                                             else published.operand)
    return quantize_1x128(x2d, E4M3), (quantize_128x128(weight, E4M3) if published is None
                                       else published.operand)


def _grad_operand(g2d: torch.Tensor, state: FP8LinearState) -> FP8Operand:
    """The output-gradient in FP8 for dgrad (and, but for blockwise, wgrad)."""
    dtype = state.recipe.backward_dtype
    if state.recipe.scaling == "delayed":
        meta = state.backward
        scale = meta.scale[state.GRAD_OUTPUT].clone()
        meta.record_amax(state.GRAD_OUTPUT, g2d)
        return quantize_tensorwise(g2d, scale, dtype)
    if state.recipe.scaling == "tensorwise":
        return _current(g2d, dtype, state)
    return quantize_1x128(g2d, dtype)


class _FP8Linear(torch.autograd.Function):
    """y = x W^T with fprop, dgrad and wgrad as FP8 GEMMs through torch._scaled_mm
    (fp8_gemm); the FP8 operands, not the inputs, are kept for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                state: FP8LinearState) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        x_fp8, w_fp8 = _forward_operands(x2d, weight, state)
        y = fp8_gemm(x_fp8, w_fp8, x.dtype)
        if not state.recipe.wgrad:  # --no-fp8-wgrad: wgrad in the run's precision
            x_in = FP8Operand(x2d, torch.ones((), device=x.device), "unquantised")
        elif state.recipe.scaling == "blockwise":  # wgrad's K is the tokens: x^T's 1x128 tiles
            x_in = quantize_1x128(x2d.t(), E4M3)
        else:
            x_in = x_fp8.t()
        ctx.save_for_backward(x_in.data, x_in.scale_inv, w_fp8.data, w_fp8.scale_inv)
        ctx.layouts = (x_in.layout, w_fp8.layout)
        ctx.state, ctx.x_shape, ctx.w_dtype = state, x.shape, weight.dtype
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        state: FP8LinearState = ctx.state
        x_data, x_scale_inv, w_data, w_scale_inv = ctx.saved_tensors
        x_in = FP8Operand(x_data, x_scale_inv, ctx.layouts[0])
        w_fp8 = FP8Operand(w_data, w_scale_inv, ctx.layouts[1])
        g2d = grad.reshape(-1, grad.shape[-1])
        g_fp8 = _grad_operand(g2d, state)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_gemm(g_fp8, w_fp8.t(), grad.dtype).view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if not state.recipe.wgrad:
                grad_w = g2d.t().matmul(x_in.data).to(ctx.w_dtype)
            elif state.recipe.scaling == "blockwise":
                grad_w = fp8_gemm(quantize_1x128(g2d.t(), state.recipe.backward_dtype), x_in,
                                  ctx.w_dtype)
            else:
                grad_w = fp8_gemm(g_fp8.t(), x_in, ctx.w_dtype)
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               state: FP8LinearState) -> torch.Tensor:
    """F.linear(x, weight, bias) as FP8 GEMMs (the bias is added in the run's precision, as
    TE's epilogue does)."""
    y = _FP8Linear.apply(x, weight, state)
    return y if bias is None else y + bias


class _BackwardEnd(torch.autograd.Function):
    """Identity whose backward runs after every other backward of the region it opens."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, region: "FP8Region") -> torch.Tensor:  # type: ignore[override]
        ctx.region = region
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        ctx.region.after_backward()
        return grad, None


class FP8Region:
    """TE's fp8_autocast around one module (a model chunk's transformer block): after its
    forward and after its backward, the layers' current amaxes are reduced with MAX over
    `amax_group` in one all-reduce and every scale is updated."""

    def __init__(self, states: Sequence[FP8LinearState], amax_group: Group = None) -> None:
        self.states = list(states)
        self.amax_group = amax_group
        self.handles: List[Any] = []

    def _reduce_and_update(self, metas: List[ScalingMeta]) -> None:
        if not metas:
            return
        rows = torch.cat([m.amax_history[0] for m in metas])
        comm.all_reduce(rows, self.amax_group, op=comm.ReduceOp.MAX)
        for m, row in zip(metas, rows.split([m.amax_history.shape[1] for m in metas])):
            m.amax_history[0].copy_(row)
            m.update()

    def after_forward(self) -> None:
        self._reduce_and_update([s.forward for s in self.states
                                 if s.recipe.scaling == "delayed"])

    def after_backward(self) -> None:
        self._reduce_and_update([s.backward for s in self.states
                                 if s.recipe.scaling == "delayed"])

    def attach(self, module: nn.Module) -> "FP8Region":
        """Open the region on `module`'s first input (its backward closes the backward
        region) and close the forward region when `module` returns."""
        def pre_hook(_module: nn.Module, args: tuple) -> Optional[tuple]:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled():
                return (_BackwardEnd.apply(x, self),) + tuple(args[1:])
            return None

        def post_hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            self.after_forward()

        self.handles = [module.register_forward_pre_hook(pre_hook),
                        module.register_forward_hook(post_hook)]
        return self


def enable_fp8(region_module: nn.Module, linears: Iterable[nn.Module], recipe: FP8Recipe,
               amax_group: Group = None) -> FP8Region:
    """Give each of `linears` (Column/RowParallelLinear) an FP8LinearState and run them under
    one FP8Region on `region_module` (which must contain them). `amax_group`: the recipe's
    -- delayed scaling's history reduction, tensorwise scaling's current amaxes."""
    inside = {id(m) for m in region_module.modules()}
    states = []
    for layer in linears:
        if id(layer) not in inside or not hasattr(layer, "fp8"):
            raise ValueError(f"enable_fp8: {type(layer).__name__} is not an FP8-capable "
                             f"tensor-parallel linear inside {type(region_module).__name__}")
        weight = getattr(layer, "weight", None)
        state = FP8LinearState(recipe, None if weight is None else weight.device,
                               amax_group if recipe.scaling == "tensorwise" else None)
        setattr(layer, "fp8", state)  # Column/RowParallelLinear.fp8
        states.append(state)
    return FP8Region(states, amax_group).attach(region_module)
