"""Horovod's PyTorch API on gigatron: `import gigatron.horovod as hvd` in place of
`import horovod.torch as hvd`, the rest of a Horovod script unchanged.

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16, op=hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Runs under `mpirun -np N python train.py`, `gigatron launch -np N`, torchrun and SLURM's
srun (and as a world of one with no launcher); gloo on CPUs, NCCL on GPUs. The names,
signatures, defaults and semantics are Horovod's (horovod.torch); the implementation lives in
engine/horovod/ (gigatron.engine.horovod.*): process sets are torch.distributed subgroups;
operations are matched by name across ranks and their dtype, shape, root rank and kind
checked before data moves (a mismatch raises RuntimeError on every rank). Horovod names not
implemented here (Adasum, SyncBatchNorm, elastic) raise NotImplementedError naming what to
use instead. `hvd.start_timeline(path)` (or
GIGATRON_TIMELINE=path) records gigatron's timeline: one Chrome trace over every rank with
each collective and the optimizer's spans.
Differences: operations are negotiated when a rank waits (synchronize, a blocking call,
barrier, join), not by a background thread, so `poll()` stays False until then;
`broadcast_optimizer_state` runs no zero-gradient step (it leaves zero gradients); see
docs/HOROVOD.md.
"""
from typing import Any, NoReturn

from gigatron.engine.horovod.basics import (Adasum, Average, HorovodInternalError, Max, Min,
                                            Product, Sum, ccl_built, cross_rank, cross_size,
                                            cuda_built, ddl_built, gloo_built, gloo_enabled,
                                            is_homogeneous, is_initialized, local_rank,
                                            local_size, mpi_built, mpi_enabled,
                                            mpi_threads_supported, nccl_built, rank, rocm_built,
                                            size, start_timeline, stop_timeline)
from gigatron.engine.horovod.compression import Compression, Compressor
from gigatron.engine.horovod.exchange import (alltoall, alltoall_async, grouped_allgather,
                                              grouped_allgather_async, grouped_reducescatter,
                                              grouped_reducescatter_async, reducescatter,
                                              reducescatter_async, sparse_allreduce_async)
from gigatron.engine.horovod.functions import (allgather_object, broadcast_object,
                                               broadcast_optimizer_state, broadcast_parameters)
from gigatron.engine.horovod.ops import (allgather, allgather_async, allreduce, allreduce_,
                                         allreduce_async, allreduce_async_, barrier, broadcast,
                                         broadcast_, broadcast_async, broadcast_async_,
                                         grouped_allreduce, grouped_allreduce_,
                                         grouped_allreduce_async, grouped_allreduce_async_, join,
                                         poll, synchronize)
from gigatron.engine.horovod.optimizer import DistributedOptimizer
from gigatron.engine.horovod.process_sets import (ProcessSet, add_process_set,
                                                  global_process_set, init,
                                                  remove_process_set, shutdown)

# Horovod names without an implementation here, and what to do instead
_MISSING = {
    "SyncBatchNorm": "use torch.nn.SyncBatchNorm on GPUs",
    "elastic": "use torchrun's elastic agent (--max-restarts) with checkpoints",
}


class _Missing:
    """Stands for a Horovod name not implemented here; using it raises NotImplementedError."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _refuse(self) -> NoReturn:
        raise NotImplementedError(f"hvd.{self._name} is not implemented in gigatron.horovod: "
                                  f"{_MISSING[self._name]}")

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        self._refuse()

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        self._refuse()


def __getattr__(name: str) -> Any:
    """A not-implemented Horovod name imports, and fails with its reason when used."""
    if name in _MISSING:
        return _Missing(name)
    raise AttributeError(f"module 'gigatron.horovod' has no attribute {name!r}")


__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank",
    "cross_size", "cross_rank", "is_homogeneous", "DistributedOptimizer", "Compression",
    "Compressor", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce",
    "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "poll", "synchronize", "barrier", "broadcast_parameters", "broadcast_optimizer_state",
    "broadcast_object", "allgather_object", "ProcessSet", "global_process_set",
    "HorovodInternalError", "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built",
    "gloo_enabled", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "start_timeline", "stop_timeline", "add_process_set", "remove_process_set", "join",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "grouped_allgather",
    "grouped_allgather_async", "sparse_allreduce_async",
]
