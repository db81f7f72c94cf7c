"""Data parallelism: flat buffers, bucketed grad reduction, ZeRO stages 0-3, mixed precision."""
from gigatron.parallel.zero.accounting import (MemoryBytes, measure_memory,
                                               zero_comm_bytes_formula, zero_memory_formula)
from gigatron.parallel.zero.config import ZeroConfig
from gigatron.parallel.zero.lamb import Lamb
from gigatron.parallel.zero.loss_scaler import DynamicLossScaler, LossScaler
from gigatron.parallel.zero.optimizer import StepResult, ZeroGroups, ZeroOptimizer, build_zero
from gigatron.parallel.zero.optimizers import OptimizerSpec

__all__ = ["ZeroConfig", "build_zero", "ZeroOptimizer", "ZeroGroups", "StepResult",
           "LossScaler", "DynamicLossScaler", "MemoryBytes", "measure_memory",
           "zero_memory_formula", "zero_comm_bytes_formula", "OptimizerSpec", "Lamb"]
