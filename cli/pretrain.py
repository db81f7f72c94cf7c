"""Pretrain a GPT model with Megatron's flags (= pretrain_gpt.py)."""
from __future__ import annotations

from typing import List, Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`gigatron pretrain FLAGS`; launch several ranks with `torchrun ... -m gigatron pretrain`."""
    from gigatron.training.run.pretrain import main as pretrain_main

    args: Optional[List[str]] = None if argv is None else list(argv)
    return pretrain_main(args, prog="gigatron pretrain")
