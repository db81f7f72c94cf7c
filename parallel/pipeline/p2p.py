"""Point-to-point transfer of activations and grads between neighbouring pipeline stages.

Every message between stages has the same shape, known from the config
([seq/tp if sequence parallel else seq, micro_batch, hidden]), so receivers allocate their
buffer up front and no shape is exchanged per step. All sends and receives of one schedule
batch go out as ONE batched isend/irecv through `gigatron.parallel.comm.send_recv` (gloo and
NCCL alike; NCCL needs the pairs posted together to avoid send/send deadlocks). Messages to
oneself (one stage holding several chunks) go through a local FIFO instead.
"""
from __future__ import annotations

from collections import deque
from typing import List, Optional, Sequence, Tuple

import torch

from gigatron.parallel import comm
from gigatron.parallel.comm import Group


def p2p_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int,
                     tp_size: int = 1, sequence_parallel: bool = False) -> Tuple[int, int, int]:
    """Shape of the hidden states passed between stages (sequence-first)."""
    if sequence_parallel:
        if seq_length % tp_size:
            raise ValueError(f"--seq-length={seq_length} must be divisible by "
                             f"--tensor-model-parallel-size={tp_size} with --sequence-parallel")
        seq_length //= tp_size
    return (seq_length, micro_batch_size, hidden_size)


class PipelineP2P:
    """Sends/receives fixed-shape tensors to/from pipeline neighbours (global ranks)."""

    def __init__(self, tensor_shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                 pp_group: Group = None, rank: Optional[int] = None) -> None:
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.pp_group = pp_group
        self.rank = comm.group_rank() if rank is None else rank
        self._to_self: deque = deque()

    def _check(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != self.tensor_shape or tensor.dtype != self.dtype:
            raise ValueError(
                f"pipeline stage output has shape {tuple(tensor.shape)} {tensor.dtype}, but the "
                f"p2p buffers expect {self.tensor_shape} {self.dtype} (from --seq-length, "
                f"--micro-batch-size, --hidden-size, --sequence-parallel): the stage must "
                f"return sequence-first hidden states of exactly that shape")

    def communicate(self, sends: Sequence[Tuple[torch.Tensor, int]],
                    recv_from: Sequence[int]) -> List[torch.Tensor]:
        """Post all `sends` (tensor, peer) and receives (one per peer in `recv_from`, in order)
        as one batch, wait for it, and return the received tensors."""
        remote_sends = []
        for tensor, peer in sends:
            self._check(tensor)
            tensor = tensor.detach().contiguous()
            if peer == self.rank:
                self._to_self.append(tensor)
            else:
                remote_sends.append((tensor, peer))
        received, remote_recvs = [], []
        for peer in recv_from:
            if peer == self.rank:
                if not self._to_self:
                    raise RuntimeError("schedule receives from itself before sending")
                received.append(self._to_self.popleft())
            else:
                buffer = torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)
                received.append(buffer)
                remote_recvs.append((buffer, peer))
        for request in comm.send_recv(remote_sends, remote_recvs, group=self.pp_group):
            request.wait()
        return received
