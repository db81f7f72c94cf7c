"""gigatron: Megatron-like 3D-parallel GPT training, and DeepSpeed's engine API for any model.

    import gigatron                      # or: import gigatron as deepspeed
    engine, optimizer, loader, scheduler = gigatron.initialize(model=model, config=ds_config)

The names below load on first use, so `import gigatron.parallel.topology` stays light.
"""
from typing import Any

_LAZY = {
    "initialize": "gigatron.engine.deepspeed.initialize",
    "add_config_arguments": "gigatron.engine.deepspeed.initialize",
    "init_distributed": "gigatron.engine.deepspeed.distributed",
    "Engine": "gigatron.engine.deepspeed.engine",
    "generate": "gigatron.models.generation",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    """DeepSpeed's top-level names, imported when first used."""
    if name not in _LAZY:
        raise AttributeError(f"module 'gigatron' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
