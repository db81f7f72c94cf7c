"""A stand-in for training/dist_checkpoint.py's two global-model functions, used by the
conversion tests only while that module does not exist: the same interface, a plain
torch.save underneath (no layouts)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import torch

TRACKER = "latest_checkpointed_iteration.txt"


def save_global_model(state_dict: Dict[str, torch.Tensor], root: str, iteration: int,
                      metadata: Dict[str, Any]) -> str:
    folder = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    torch.save(state_dict, os.path.join(folder, "model.pt"))
    with open(os.path.join(folder, "metadata.json"), "w") as f:
        json.dump({"iteration": iteration, **metadata}, f)
    with open(os.path.join(root, TRACKER), "w") as f:
        f.write(f"{iteration}\n")
    return folder


def load_global_model(root_or_folder: str) -> Tuple[Dict[str, torch.Tensor], Dict[str, Any]]:
    folder = root_or_folder
    if os.path.isfile(os.path.join(root_or_folder, TRACKER)):
        iteration = int(open(os.path.join(root_or_folder, TRACKER)).read())
        folder = os.path.join(root_or_folder, f"iter_{iteration:07d}")
    with open(os.path.join(folder, "metadata.json")) as f:
        metadata = json.load(f)
    return torch.load(os.path.join(folder, "model.pt")), metadata
