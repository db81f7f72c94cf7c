"""Megatron's FP8 flags (--fp8-format and its family) -> the FP8 recipe of the linears.

Megatron-Core hands these flags to Transformer Engine's recipes (DelayedScaling,
Float8CurrentScaling, Float8BlockScaling); gigatron runs the same recipes in its
tensor-parallel linears (`gigatron.parallel.tensor.fp8`, docs/FP8.md): the same layers,
formats and scales, the GEMMs in FP8 through torch._scaled_mm. mxfp8 and custom are refused
with the reason. --fp8-param-gather makes the distributed optimizer (ZeRO 1-2) quantise its
shards of the updated weights and all-gather the FP8 linears' weights in FP8, which the
linears then use as they are (`gigatron.parallel.zero.fp8_gather`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

from gigatron.training.config.field import setting

if TYPE_CHECKING:
    from gigatron.parallel.tensor.fp8 import FP8Recipe
    from gigatron.training.config.table import Settings

RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")  # Megatron's choices
SCALINGS = ("delayed", "tensorwise", "blockwise")  # the ones gigatron runs


@dataclass(frozen=True)
class FP8Settings:
    """FP8 training through Transformer Engine in Megatron, through torch._scaled_mm here
    (docs/FP8.md)."""

    fp8_format: Optional[str] = setting(
        None, "FP8 GEMMs in the transformer layers' linears (torch._scaled_mm, docs/FP8.md): e4m3 "
        "everywhere, or hybrid (E4M3 activations and weights, E5M2 output-gradients); the "
        "embedding and output layer stay in the run's dtype, as in Megatron-Core",
        "--fp8-format", choices=("e4m3", "hybrid"))
    fp8_recipe: str = setting(
        "delayed", "FP8 scaling recipe: delayed (scales from the amax history), tensorwise "
        "(each tensor's current amax) or blockwise (DeepSeek-V3's 1x128 activation and "
        "gradient tiles, 128x128 weight tiles); mxfp8 and custom are refused", "--fp8-recipe",
        choices=RECIPES)
    fp8_margin: int = setting(0, "scale = FP8 max / amax / 2**margin", "--fp8-margin")
    fp8_interval: int = setting(
        1, "accepted without effect: deprecated by Transformer Engine 1.8 (scales update "
        "every step), as Megatron warns", "--fp8-interval")
    fp8_amax_history_len: int = setting(
        1, "steps of amax history the scale is computed from", "--fp8-amax-history-len")
    fp8_amax_compute_algo: str = setting(
        "most_recent", "the amax of the history: its max, or the most recent step's",
        "--fp8-amax-compute-algo", choices=("max", "most_recent"))
    no_fp8_wgrad: bool = setting(
        False, "compute the weight-gradient GEMM in the run's precision, not in FP8 "
        "(delayed recipe only, as in Megatron)",
        "--no-fp8-wgrad", "--disable-fp8-wgrad")
    fp8_param_gather: bool = setting(
        False, "the distributed optimizer (ZeRO 1-2) quantises its shards of the FP8 linears' "
        "updated weights with the recipe's scales and all-gathers them in FP8 (one byte per "
        "element); the linears use the gathered FP8 weights without quantising them again "
        "(needs --fp8-format and the distributed optimizer, as in Megatron; the weights in "
        "the run's dtype are kept, holding the FP8 values: communication is saved, not "
        "Megatron's memory)", "--fp8-param-gather")


def fp8_recipe(fp8: FP8Settings) -> Optional["FP8Recipe"]:
    """The FP8 recipe of these (validated) settings; None without --fp8-format.
    --no-fp8-wgrad acts on delayed scaling only (Megatron passes it to DelayedScaling's
    override_linear_precision, not to the other recipes)."""
    from gigatron.parallel.tensor.fp8 import FP8Recipe

    if not fp8.fp8_format:
        return None
    return FP8Recipe(format=fp8.fp8_format, margin=fp8.fp8_margin,
                     amax_history_len=fp8.fp8_amax_history_len,
                     amax_compute_algo=fp8.fp8_amax_compute_algo,
                     wgrad=not (fp8.no_fp8_wgrad and fp8.fp8_recipe == "delayed"),
                     scaling=fp8.fp8_recipe)


def fp8_problems(s: "Settings") -> List[str]:
    """What Megatron (or gigatron) refuses in the FP8 flags, one line each."""
    out: List[str] = []
    fp8, precision, model = s.fp8, s.precision, s.model
    if fp8.fp8_param_gather:
        if not fp8.fp8_format:
            out.append("--fp8-param-gather needs --fp8-format (Megatron: fp8_param must be "
                       "used together with fp8 mode)")
        if not (precision.use_distributed_optimizer or (precision.zero_stage or 0) >= 1):
            out.append("--fp8-param-gather needs the distributed optimizer: add "
                       "--use-distributed-optimizer (or --zero-stage 1 or 2)")
        if precision.zero_stage == 3:
            out.append("--fp8-param-gather is not built for --zero-stage 3 (its per-layer "
                       "gathers are in the run's dtype): use --zero-stage 1 or 2, or drop "
                       "--fp8-param-gather")
    if not fp8.fp8_format:
        return out
    if fp8.fp8_recipe not in SCALINGS:
        out.append(f"--fp8-recipe {fp8.fp8_recipe} is not supported: gigatron runs "
                   f"delayed, tensorwise and blockwise scaling; choose one of those")
    if fp8.fp8_amax_history_len < 1:
        out.append(f"--fp8-amax-history-len must be >= 1, got {fp8.fp8_amax_history_len}")
    return out


def fp8_notes(fp8: FP8Settings, overlap_param_gather: bool = False) -> List[str]:
    """The banner's lines for the FP8 flags."""
    notes = []
    if fp8.fp8_format:
        delayed = fp8.fp8_recipe == "delayed"
        wgrad = ", weight gradients in full precision" if fp8.no_fp8_wgrad and delayed else ""
        how = (f"delayed scaling (amax history {fp8.fp8_amax_history_len}, "
               f"{fp8.fp8_amax_compute_algo})" if delayed else f"{fp8.fp8_recipe} scaling")
        notes.append(f"--fp8-format {fp8.fp8_format}: the transformer layers' GEMMs run in "
                     f"FP8 through torch._scaled_mm with {how}{wgrad} (docs/FP8.md)")
    if fp8.fp8_param_gather:
        notes.append("--fp8-param-gather: the distributed optimizer all-gathers the FP8 "
                     "linears' weights in FP8 (one byte per element) and the linears use them "
                     "as gathered (parallel/zero/fp8_gather.py)")
        if overlap_param_gather:
            notes.append("--fp8-param-gather with --overlap-param-gather: the FP8 weights are "
                         "gathered right after the step, not under the next forward")
    return notes
