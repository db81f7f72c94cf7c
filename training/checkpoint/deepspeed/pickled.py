"""Unpickling DeepSpeed's checkpoint files without the `deepspeed` package.

DeepSpeed 0.19's ZeRO optimizer files pickle a few of its own objects: the loss scaler
(`deepspeed.runtime.fp16.loss_scaler.LossScaler` / `DynamicLossScaler`), the stage
(`deepspeed.runtime.zero.config.ZeroStageEnum`, an int enum) and each parameter's place in
the flat partition (`deepspeed.utils.tensor_fragment.fragment_address`, a dataclass). A
plain `torch.load` imports deepspeed to rebuild them, so a user who moved off DeepSpeed got
"No module named 'deepspeed'". Here every `deepspeed.*` class becomes a stand-in: an enum
member comes back as its value (the int the reader wants), any other object as a stand-in
holding the attributes it was saved with (`cur_scale`, `cur_iter`, ...), whether or not
deepspeed is installed. Other missing classes (Megatron's, in a Megatron-DeepSpeed run's
args) become the placeholders of `gigatron.models.megatron.files.LenientPickle`.
"""
from __future__ import annotations

import pickle
from typing import Any, Dict, Tuple

from gigatron.models.megatron.files import placeholder_class

_SCALARS = (int, float, str, bool)


class DeepSpeedStandIn:
    """Stands in for a DeepSpeed class: built from its pickled state, it keeps the saved
    attributes; called with one plain value (how pickle rebuilds an enum member), it is
    that value."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and isinstance(args[0], _SCALARS):
            return args[0]
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__name__} stand-in {vars(self)}>"


_STAND_INS: Dict[Tuple[str, str], type] = {}


def stand_in(module: str, name: str) -> type:
    """The stand-in class of DeepSpeed's `module.name` (one per name, so isinstance holds
    across files)."""
    key = (module, name)
    if key not in _STAND_INS:
        _STAND_INS[key] = type(name, (DeepSpeedStandIn,), {"__module__": module})
    return _STAND_INS[key]


def is_deepspeed(module: str) -> bool:
    return module == "deepspeed" or module.startswith("deepspeed.")


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if is_deepspeed(module):
            return stand_in(module, name)
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):  # as LenientPickle (Megatron's classes)
            return placeholder_class(module, name)


class DeepSpeedPickle:
    """A pickle module for torch.load that reads DeepSpeed's files without importing it."""

    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    __name__ = "gigatron_deepspeed_pickle"
