"""The attention and MLP kinds chosen per layer by the config (DESIGN decision 17): sliding
windows (--window-size, --window-attn-skip-freq), sink logits (--softmax-type) and gated
activations with an offset and a clamp (--quick-geglu, --glu-linear-offset,
--activation-func-clamp-value), with Megatron-Core's meanings.

The attention itself is `gigatron.parallel.context.band` (one device) and the context-parallel
comm types built on it; this module only says which kind each layer is and checks the config.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def is_window_layer(config: Any, layer_number: int) -> bool:
    """Whether layer `layer_number` (0-based, global) has a sliding window: Megatron-Core's
    is_layer_window_attention on the 1-based number (N: every Nth layer is full; a list:
    1 = window, 0 = full; None: every layer)."""
    if not config.window_size or layer_window_size(config.window_size) is None:
        return False
    freq = config.window_attn_skip_freq
    if freq is None:
        return True
    if isinstance(freq, int):
        return (layer_number + 1) % freq != 0
    return bool(freq[layer_number])


def layer_window_size(window_size: Any) -> Optional[int]:
    """The left window L of (L, 0); None when infinite (-1)."""
    left = window_size[0]
    return None if left < 0 else int(left)


def layer_window(config: Any, layer_number: int) -> Optional[int]:
    """The keys before each query that layer `layer_number` sees; None: all of them."""
    if not is_window_layer(config, layer_number):
        return None
    return layer_window_size(config.window_size)


def has_sink(config: Any) -> bool:
    """Whether the softmax has a sink logit (off-by-one's 0 or a learned one per head)."""
    return config.softmax_type != "vanilla"


def uses_band_attention(config: Any, layer_number: int) -> bool:
    """Whether layer `layer_number` runs the band attention (a window or a sink)."""
    return has_sink(config) or layer_window(config, layer_number) is not None


def mean_key_span(config: Any) -> float:
    """Keys per query the attention computes, averaged over the layers, counted as the
    planner counts a causal layer (its whole sequence: the mask's skipped half included):
    a windowed layer's band blocks span about twice their size, max(window + 1, 128)
    (parallel/context/band.py), capped by the sequence."""
    s, spans = config.seq_length, []
    for layer in range(config.num_layers):
        window = layer_window(config, layer)
        spans.append(s if window is None else min(s, 2 * max(window + 1, 128)))
    return sum(spans) / len(spans)


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x sigmoid(1.702 x), Megatron-Core's quick_gelu (gpt-oss's GLU)."""
    return x * torch.sigmoid(1.702 * x)


def gated_activation(act: Callable[[torch.Tensor], torch.Tensor], offset: float = 0.0,
                     clamp: Optional[float] = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gated unit over [gate, linear] halves of the last dim: act(gate) * (linear +
    offset), the gate clamped to <= clamp and the linear half to [-clamp, clamp] (Megatron-
    Core's glu with glu_linear_offset and activation_func_clamp_value)."""
    def glu(x: torch.Tensor) -> torch.Tensor:
        gate, linear = x.chunk(2, dim=-1)
        if clamp is not None:
            gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
        return act(gate) * (linear + offset if offset else linear)
    return glu


# the gated activations (fc1 holds [gate, linear]) and what each applies to its gate
GATED: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"swiglu": F.silu,
                                                            "quick_geglu": quick_gelu}


def attention_kind_problems(config: Any) -> List[str]:
    """Every reason the window, sink and gated-activation fields cannot run, naming the flag."""
    out = []
    window = config.window_size
    if window is not None:
        if len(window) != 2 or not all(isinstance(w, int) for w in window):
            out.append(f"--window-size {window}: give two integers L,0")
        elif window[1] != 0 or window[0] < -1:
            out.append(f"--window-size {window[0]},{window[1]}: only causal windows L,0 "
                       f"(L >= 0, or -1: no window) are supported")
    freq = config.window_attn_skip_freq
    if freq is not None:
        if window is None:
            out.append("--window-attn-skip-freq needs --window-size L,0")
        if isinstance(freq, list) and len(freq) != config.num_layers:
            out.append(f"--window-attn-skip-freq lists {len(freq)} layers for --num-layers "
                       f"{config.num_layers}: give one 0/1 per layer")
        if isinstance(freq, int) and freq < 1:
            out.append(f"--window-attn-skip-freq {freq}: must be >= 1")
    gated = config.activation in GATED
    if not gated and (config.glu_linear_offset or config.activation_func_clamp_value is not None):
        out.append("--glu-linear-offset and --activation-func-clamp-value apply to gated "
                   "units: add --swiglu or --quick-geglu")
    clamp = config.activation_func_clamp_value
    if clamp is not None and not clamp > 0:
        out.append(f"--activation-func-clamp-value {clamp}: must be > 0")
    return out


def dropout_seed(tracker: Any, device: torch.device) -> int:
    """The seed of a band layer's attention-dropout masks (parallel/context/band.py), drawn
    from the tensor-parallel rank's stream as the other attention dropout (one host read)."""
    with tracker.fork(device) if tracker is not None else contextlib.nullcontext():
        return int(torch.randint(0, 2 ** 62, (1,), device=device).item())


def cached_band_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          mask: torch.Tensor, window: Optional[int],
                          sink: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """Inference over a KV cache for a window/sink layer: q [s, b, n, d], k [b, g, t, d],
    v [b, g, t, dv] (every cached slot), mask [b, 1, s, t] (True: may attend; the s new
    tokens are the last s slots) -> [s, b, n*dv]. Real tokens fill consecutive slots after
    the left padding, so the window counts slots. Explicit scores: a step is short."""
    s, b, n, _ = q.shape
    t = k.shape[2]
    k, v = (x.repeat_interleave(n // x.shape[1], dim=1) for x in (k, v))
    scores = torch.matmul(q.permute(1, 2, 0, 3).float(), k.float().transpose(-1, -2)) * scale
    if window is not None:
        rows = torch.arange(t - s, t, device=q.device)[:, None]
        mask = mask & (rows - torch.arange(t, device=q.device)[None, :] <= window)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink is not None:
        scores = torch.cat([scores, sink.float()[None, :, None, None].expand(b, n, s, 1)], -1)
    probs = torch.softmax(scores, dim=-1)[..., :t]
    out = torch.matmul(probs, v.float()).to(q.dtype)  # [b, n, s, dv]
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
