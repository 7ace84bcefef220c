"""Reshard transport over a gloo process group: tensors are staged through CPU buffers.

Without a ``group`` the service creates a gloo group over the whole world (a collective call), so it
also moves CUDA tensors where NCCL cannot reach (across clusters).
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

__all__ = ["GlooCopyService"]


def _cpu_buffer(like: torch.Tensor) -> torch.Tensor:
    pin = like.is_cuda and torch.cuda.is_available()
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)


class GlooCopyService(CopyService):
    """Queue sends/receives and run them over gloo with CPU staging; self-copies stay on their device."""

    def __init__(self, group: Any = None) -> None:
        super().__init__(group=group)
        self._owns_group = group is None
        self.gloo_pg = group if group is not None else dist.new_group(backend="gloo")
        self.send_ops: list[SendOp] = []
        self.recv_ops: list[tuple[RecvOp, torch.Tensor]] = []

    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int, task_id: int | None = None) -> None:
        """Queue a send of ``src_tensor`` to ``dest_rank``."""
        self.send_ops.append(SendOp(task_id, src_tensor, dest_rank))

    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int, task_id: int | None = None) -> None:
        """Queue a receive into ``dest_tensor`` from ``src_rank`` (through a CPU buffer unless it is on CPU)."""
        buffer = dest_tensor if dest_tensor.device.type == "cpu" else _cpu_buffer(dest_tensor)
        self.recv_ops.append((RecvOp(task_id, buffer, src_rank), dest_tensor))

    def run(self) -> None:
        """Local copies, then the remote ops as one gloo batch, then copy CPU buffers to their tensors."""
        local_sends = [op for op in self.send_ops if op.dest_rank == self.rank]
        local_recvs = [RecvOp(r.task_id, dst, r.src_rank) for r, dst in self.recv_ops if r.src_rank == self.rank]
        local_copies(match_local_ops_by_task_id(local_sends, local_recvs, "GlooCopyService", self.rank))
        remote_recvs = [(r, dst) for r, dst in self.recv_ops if r.src_rank != self.rank]
        ops = []
        for op in self.send_ops:
            if op.dest_rank != self.rank:
                cpu = op.tensor.detach()
                if cpu.device.type != "cpu":
                    cpu = _cpu_buffer(cpu).copy_(cpu)
                ops.append(dist.P2POp(dist.isend, cpu, **peer_kwargs(self.gloo_pg, op.dest_rank)))
        ops += [dist.P2POp(dist.irecv, r.tensor, **peer_kwargs(self.gloo_pg, r.src_rank)) for r, _ in remote_recvs]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        with torch.no_grad():
            for r, dst in remote_recvs:
                if r.tensor is not dst:
                    dst.copy_(r.tensor)
        self.send_ops.clear()
        self.recv_ops.clear()

    def close(self) -> None:
        """Destroy the gloo group this service created (a group passed in is left alone)."""
        if self._owns_group and self.gloo_pg is not None:
            dist.destroy_process_group(self.gloo_pg)
            self.gloo_pg = None
