"""Reshard transport over the process group's own backend with ``torch.distributed.batch_isend_irecv``.

Named for NCCL (device tensors, no staging), it moves whatever tensors the group's backend accepts:
CUDA tensors over NCCL, CPU tensors over gloo.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core.resharding.copy_services.base import (
    CopyService,
    RecvOp,
    SendOp,
    local_copies,
    match_local_ops_by_task_id,
    peer_kwargs,
)

__all__ = ["NCCLCopyService"]


class NCCLCopyService(CopyService):
    """Queue sends/receives and run them as one ``batch_isend_irecv`` on ``group``; self-copies stay local."""

    def __init__(self, group: Any = None) -> None:
        super().__init__(group=group)
        self.send_ops: list[SendOp] = []
        self.recv_ops: list[RecvOp] = []

    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int, task_id: int | None = None) -> None:
        """Queue a send of ``src_tensor`` to ``dest_rank``."""
        self.send_ops.append(SendOp(task_id, src_tensor, dest_rank))

    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int, task_id: int | None = None) -> None:
        """Queue a receive into ``dest_tensor`` (contiguous) from ``src_rank``."""
        self.recv_ops.append(RecvOp(task_id, dest_tensor, src_rank))

    def run(self) -> None:
        """Local copies first, then every remote op in one batch; waits for all of them."""
        local_sends = [op for op in self.send_ops if op.dest_rank == self.rank]
        local_recvs = [op for op in self.recv_ops if op.src_rank == self.rank]
        local_copies(match_local_ops_by_task_id(local_sends, local_recvs, "NCCLCopyService", self.rank))
        ops = [dist.P2POp(dist.isend, op.tensor, **peer_kwargs(self.group, op.dest_rank))
               for op in self.send_ops if op.dest_rank != self.rank]
        ops += [dist.P2POp(dist.irecv, op.tensor, **peer_kwargs(self.group, op.src_rank))
                for op in self.recv_ops if op.src_rank != self.rank]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        self.send_ops.clear()
        self.recv_ops.clear()
