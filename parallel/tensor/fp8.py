"""FP8 *emulation* of Transformer Engine's delayed-scaling recipe for the tensor-parallel linears.

Megatron-Core with `--fp8-format` runs the GEMMs of its transformer layers (linear_qkv,
linear_proj, linear_fc1, linear_fc2; not the embedding, not the output layer, not core
attention) through Transformer Engine in FP8. There is no FP8 hardware and no TE here, so the
numbers are emulated:

* What is emulated exactly: every GEMM operand of those layers is rounded through a real
  torch FP8 dtype with a per-tensor scale, as TE does: forward activations and weights in
  E4M3 (torch.float8_e4m3fn, max 448); output-gradients in backward in E5M2
  (torch.float8_e5m2, max 57344) with `hybrid`, in E4M3 with `e4m3`. Quantising is
  q = saturate(x * scale) cast to FP8 (round to nearest even), dequantising q / scale.
  dgrad uses the quantised output-gradient and weight; wgrad the quantised output-gradient
  and input, or both in the run's precision with `wgrad=False` (Megatron's --no-fp8-wgrad).
* The delayed-scaling recipe, as TE computes it: each operand's amax is recorded in the
  current row of an amax history of `amax_history_len` rows; at the end of every forward
  of a model chunk (TE: leaving fp8_autocast) and at the end of its backward, the current
  amaxes of all layers are reduced with MAX over the amax group (Megatron's default: the
  stage's tensor- and data-parallel ranks) in one all-reduce, the amax is taken from the
  history (`max` over the window or the `most_recent` row), the history rolls, and the
  next scale is fp8_max / amax / 2**margin (kept when the amax is 0 or not finite). The
  first step runs with scale 1 (empty history), as TE does.
* What differs from TE on an H100: the GEMM itself runs in the run's dtype on the
  dequantised operands (the operands are rounded to FP8 values, then to the run's dtype,
  which adds at most half an ulp of bf16 to the FP8 error, and the product accumulates in
  fp32 or the run's dtype, not in the tensor cores' FP8 pipeline) -- so it is *slower*
  than the same GEMM in bf16, never faster, and it saves no memory: the saved activations
  are the dequantised copies in the run's dtype, not FP8 bytes. The weight is re-quantised
  on every forward (TE keeps one FP8 copy per step and re-casts it on the first
  micro-batch only; the values differ only when the weight scale changed between
  micro-batches).
* Activation recomputation (parallel/tensor/random.checkpoint): as TE, the recomputed
  forward quantises with the scales its original forward used and records no amax, so a
  recomputed layer computes what a kept one does (`recording` / `replaying`).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Deque, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from gigatron.parallel import comm
from gigatron.parallel.comm import Group

FORMATS = ("e4m3", "hybrid")
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@dataclass(frozen=True)
class FP8Recipe:
    """Transformer Engine's DelayedScaling recipe, as Megatron-Core builds it from its flags."""

    format: str = "hybrid"  # e4m3: E4M3 everywhere; hybrid: E5M2 for output-gradients
    margin: int = 0
    amax_history_len: int = 1
    amax_compute_algo: str = "most_recent"
    wgrad: bool = True  # the weight-gradient GEMM in FP8 (False: in the run's precision)

    def __post_init__(self) -> None:
        problems = [msg for ok, msg in (
            (self.format in FORMATS, f"format must be one of {FORMATS}, got {self.format!r}"),
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


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2)."""
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the FP8 range and rounded to `dtype` (computed in fp32)."""
    top = fp8_max(dtype)
    return (x.float() * scale).clamp_(-top, top).to(dtype)


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

    def quantize(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Operand i of this step: its amax joins the current row; quantised with the
        scale the history gave (delayed scaling)."""
        row = self.amax_history[0]
        row[i] = torch.maximum(row[i], amax(x))
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


class FP8LinearState:
    """The FP8 state of one linear layer: forward meta (input, weight), backward meta
    (output-gradient)."""

    INPUT, WEIGHT, GRAD_OUTPUT = 0, 1, 0

    def __init__(self, recipe: FP8Recipe, device: Optional[torch.device] = None) -> None:
        self.recipe = recipe
        self.forward = ScalingMeta(2, recipe.forward_dtype, recipe, device)
        self.backward = ScalingMeta(1, recipe.backward_dtype, recipe, device)


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


def _forward_operands(x: torch.Tensor, weight: torch.Tensor,
                      state: FP8LinearState) -> Tuple[torch.Tensor, torch.Tensor]:
    """x and the weight rounded through FP8 with this forward's scales (recorded for a
    recomputation, or replayed in one)."""
    meta = state.forward
    if _REPLAYS and _REPLAYS[-1]:
        x_scale, w_scale = _REPLAYS[-1].popleft()
        x_fp8 = quantize(x, x_scale, meta.dtype)
        w_fp8 = quantize(weight, w_scale, meta.dtype)
    else:
        x_scale, w_scale = meta.scale[state.INPUT].clone(), meta.scale[state.WEIGHT].clone()
        x_fp8 = meta.quantize(state.INPUT, x)
        w_fp8 = meta.quantize(state.WEIGHT, weight)
    for store in _RECORDINGS:
        store.append((x_scale, w_scale))
    return dequantize(x_fp8, x_scale, x.dtype), dequantize(w_fp8, w_scale, weight.dtype)


class _FP8Linear(torch.autograd.Function):
    """y = dq(q(x)) dq(q(W))^T; dgrad and wgrad from the quantised output-gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                state: FP8LinearState) -> torch.Tensor:
        x_q, w_q = _forward_operands(x, weight, state)
        wgrad_input = x_q if state.recipe.wgrad else x
        ctx.save_for_backward(wgrad_input, w_q)
        ctx.state = state
        return F.linear(x_q, w_q)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor  # type: ignore[override]
                 ) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        wgrad_input, w_q = ctx.saved_tensors
        state: FP8LinearState = ctx.state
        meta = state.backward
        g_scale = meta.scale[state.GRAD_OUTPUT].clone()
        g_q = dequantize(meta.quantize(state.GRAD_OUTPUT, grad), g_scale, grad.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = g_q.matmul(w_q)
        if ctx.needs_input_grad[1]:
            g = g_q if state.recipe.wgrad else grad
            grad_w = g.reshape(-1, g.shape[-1]).t().matmul(
                wgrad_input.reshape(-1, wgrad_input.shape[-1]))
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
               state: FP8LinearState) -> torch.Tensor:
    """F.linear(x, weight, bias) with the GEMM's operands rounded through FP8 (the bias is
    added in the run's precision, as TE's epilogue does)."""
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
        self._reduce_and_update([s.forward for s in self.states])

    def after_backward(self) -> None:
        self._reduce_and_update([s.backward for s in self.states])

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
    one FP8Region on `region_module` (which must contain them)."""
    inside = {id(m) for m in region_module.modules()}
    states = []
    for layer in linears:
        if id(layer) not in inside or not hasattr(layer, "fp8"):
            raise ValueError(f"enable_fp8: {type(layer).__name__} is not an FP8-capable "
                             f"tensor-parallel linear inside {type(region_module).__name__}")
        weight = getattr(layer, "weight", None)
        state = FP8LinearState(recipe, None if weight is None else weight.device)
        setattr(layer, "fp8", state)  # Column/RowParallelLinear.fp8
        states.append(state)
    return FP8Region(states, amax_group).attach(region_module)
