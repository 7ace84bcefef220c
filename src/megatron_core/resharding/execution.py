"""Run a :class:`~megatron_core.resharding.utils.ReshardPlan` through a copy service.

Sends are slices of the source tensors (made contiguous); receives land straight in the destination
tensors when the slice is contiguous, else in a buffer copied in after the transfer.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.resharding.copy_services.base import CopyService
from megatron_core.resharding.transforms import ReshardTransform
from megatron_core.resharding.utils import ReshardPlan, get_refit_tensor_dict

__all__ = ["execute_reshard_plan"]

logger = logging.getLogger(__name__)


def _synchronize_cuda() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


@torch.no_grad()
def execute_reshard_plan(plan: ReshardPlan, src_module: torch.nn.Module | None,
                         dst_module: torch.nn.Module | None, service: CopyService, group: Any = None,
                         transform: ReshardTransform | None = None) -> None:
    """Send this rank's source slices and receive its destination slices as ``plan`` says.

    ``src_module`` / ``dst_module`` may be ``None`` on ranks that only receive / only send. Tensors that
    ``transform.should_transform`` claims use the transform's send, receive and write-back hooks.
    """
    src = get_refit_tensor_dict(src_module) if src_module is not None else {}
    dst = get_refit_tensor_dict(dst_module) if dst_module is not None else {}
    claimed = transform.should_transform if transform is not None else (lambda name: False)
    for op in plan.send_ops:
        tensor = src.get(op.param_name)
        if tensor is None:
            continue
        if claimed(op.param_name):
            for piece in transform.prepare_send(op.param_name, op.my_slice, tensor):
                service.submit_send(piece.contiguous(), op.peer_rank, task_id=op.task_id)
        else:
            service.submit_send(tensor.detach()[op.my_slice].contiguous(), op.peer_rank, task_id=op.task_id)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    finals: list[tuple[str, tuple, list[torch.Tensor]]] = []
    for op in plan.recv_ops:
        if claimed(op.param_name):
            buffers = transform.prepare_recv(op.param_name, op.my_slice)
            for buf in buffers:
                service.submit_recv(buf, op.peer_rank, task_id=op.task_id)
            finals.append((op.param_name, op.my_slice, buffers))
            continue
        tensor = dst.get(op.param_name)
        if tensor is None:
            continue
        view = tensor.detach()[op.my_slice]
        if view.is_contiguous():
            service.submit_recv(view, op.peer_rank, task_id=op.task_id)
        else:
            buffer = torch.empty_like(view, memory_format=torch.contiguous_format)
            service.submit_recv(buffer, op.peer_rank, task_id=op.task_id)
            copies.append((view, buffer))
    logger.debug("resharding: %d sends, %d recvs", len(plan.send_ops), len(plan.recv_ops))
    service.run()
    _synchronize_cuda()
    if service.requires_process_group_barrier:
        dist.barrier(group=group)
    for view, buffer in copies:
        view.copy_(buffer)
    for name, dst_slice, buffers in finals:
        transform.finalize_recv(name, dst_slice, buffers)
    _synchronize_cuda()
