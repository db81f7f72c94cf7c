#!/usr/bin/env python
"""Megatron's entry point: pretrain a GPT model (the same code as `gigatron pretrain`).

    torchrun --nproc-per-node 8 pretrain_gpt.py --tensor-model-parallel-size 2 ... (see --help)
"""
import sys

from gigatron.training.run.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
