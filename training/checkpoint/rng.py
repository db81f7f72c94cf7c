"""The random generators a step draws from, saved and restored on any device.

One helper for every checkpoint: pretrain_gpt.py's (which adds each model chunk's
tensor-parallel tracker, training/checkpoint/orchestrator.py) and the engine's
(engine/deepspeed/checkpoint.py). The device's generator is read through torch's device
module (`gigatron.parallel.tensor.random`), so a GPU, an XPU or any accelerator is saved
alike; a CPU run has only the CPU generator.
"""
from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def generator_states(device: torch.device) -> Dict[str, Any]:
    """Python's, NumPy's and torch's CPU generators, and `device`'s default one off the CPU."""
    from gigatron.parallel.tensor.random import get_rng_state

    state: Dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                             "torch": torch.get_rng_state()}
    if device.type != "cpu":
        state["accelerator"] = get_rng_state(device)
    return state


def restore_generators(state: Dict[str, Any], device: torch.device) -> None:
    """Put back what `generator_states` saved (the accelerator's only on an accelerator)."""
    from gigatron.parallel.tensor.random import set_rng_state

    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    # "cuda": the key of the engine's per-rank checkpoints written before the torch_dist ones
    accelerator = state.get("accelerator", state.get("cuda"))
    if device.type != "cpu" and accelerator is not None:
        set_rng_state(accelerator, device)
