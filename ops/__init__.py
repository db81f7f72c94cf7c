"""Fused ops: compiled CUDA kernels when present, else Apex, else plain torch."""
