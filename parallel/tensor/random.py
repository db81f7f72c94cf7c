"""RNG for tensor-parallel regions, and activation recomputation that replays it.

Dropout on activations that are *replicated* across tp ranks (the residual stream without
sequence parallelism) must draw the same mask on every tp rank: it uses the default
generator, which the training loop seeds identically across tp. Dropout on activations that
are *split* across tp (attention probabilities of this rank's heads; the sequence slice under
sequence parallelism) must draw different masks per rank: it runs inside
`tracker.fork()`, which swaps in a separate generator state seeded per tp rank.

Only device-agnostic torch calls are used (`torch.get_device_module`), so it runs on CPU.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.utils.checkpoint

from gigatron.parallel.tensor import fp8

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset so the tracked stream never coincides with the default stream's seed.
TP_SEED_OFFSET = 2718


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state for `device` (CPU or an accelerator)."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    """Restore the default generator's state for `device`."""
    device = torch.device(device)
    if device.type == "cpu":
        torch.set_rng_state(state)
    else:
        torch.get_device_module(device.type).set_rng_state(state, device)


def _seeded_state(seed: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen.get_state()


class TensorParallelRNGTracker:
    """Named generator states swapped in around tensor-parallel regions (per device)."""

    def __init__(self) -> None:
        self._seeds: Dict[str, int] = {}
        self._states: Dict[tuple, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        """Register stream `name` seeded with `seed` (states are made per device lazily)."""
        if name in self._seeds:
            raise ValueError(f"RNG stream {name!r} is already registered")
        if seed in self._seeds.values():
            raise ValueError(f"seed {seed} is already used by another RNG stream")
        self._seeds[name] = seed

    def get_states(self) -> Dict[tuple, torch.Tensor]:
        """A copy of every stream's state (for recomputation and checkpoints)."""
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: Dict[tuple, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}

    @contextlib.contextmanager
    def fork(self, device: torch.device, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with stream `name` as the default generator of `device`."""
        if name not in self._seeds:
            raise ValueError(f"RNG stream {name!r} was never added to the tracker")
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.get_device_module(device.type)
                                  .current_device())
        key = (name, str(device))
        if key not in self._states:
            self._states[key] = _seeded_state(self._seeds[name], device)
        saved = get_rng_state(device)
        set_rng_state(self._states[key], device)
        try:
            yield
        finally:
            self._states[key] = get_rng_state(device)
            set_rng_state(saved, device)


def model_parallel_seed(seed: int, tp_rank: int) -> int:
    """Seed of the tracked stream: distinct per tp rank, distinct from `seed` itself."""
    return seed + TP_SEED_OFFSET + tp_rank


def _tracker_contexts(tracker: Optional[TensorParallelRNGTracker]):
    """Context pair for torch checkpoint: record tracker states (and the FP8 scales the
    forward used) in forward, replay them in recomputation, then put back whatever the
    tracker held before the replay."""
    recorded: Dict[str, Any] = {}
    scales: List[Any] = []

    @contextlib.contextmanager
    def forward_ctx():
        if tracker is not None:
            recorded["states"] = tracker.get_states()
        with fp8.recording(scales):
            yield

    @contextlib.contextmanager
    def recompute_ctx():
        if tracker is None:
            with fp8.replaying(scales):
                yield
            return
        current = tracker.get_states()
        tracker.set_states(recorded["states"])
        try:
            with fp8.replaying(scales):
                yield
        finally:
            tracker.set_states(current)

    return forward_ctx(), recompute_ctx()


def checkpoint(function: Callable, tracker: Optional[TensorParallelRNGTracker],
               *args: Any, keep: Optional[Callable[[], Tuple[Any, Any]]] = None) -> Any:
    """Run `function(*args)` without keeping its activations; recompute them in backward.

    Default-generator states (CPU and the inputs' device) and the tracker's streams are
    replayed, so dropout draws the same masks and gradients are bit-identical; FP8 linears
    replay the scales of the original forward. `keep`: a selective policy's context pair
    (selective.op_contexts), whose kept op outputs are not recomputed.
    """
    if torch.compiler.is_compiling():
        # inside a compiled layer (--torch-compile) dynamo traces the checkpoint into the
        # layer's graph and AOT autograd recomputes it in backward within that graph, from
        # the same graph inputs (FP8 scales included): the Python-side recording and
        # replaying of RNG and scale state is not traced
        if keep is None:
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False,
                                                 context_fn=keep)

    def contexts() -> Tuple[Any, Any]:
        forward, recompute = _tracker_contexts(tracker)
        if keep is None:
            return forward, recompute
        kept_forward, kept_recompute = keep()
        return _both(forward, kept_forward), _both(recompute, kept_recompute)
    return torch.utils.checkpoint.checkpoint(
        function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


@contextlib.contextmanager
def _both(outer: Any, inner: Any) -> Iterator[None]:
    with outer, inner:
        yield
