"""The NIXL (UCX RDMA) reshard transport is not part of this library.

Constructing :class:`NixlCopyService` raises ``ImportError`` naming what it needs; use
:class:`~megatron_core.resharding.copy_services.gloo_copy_service.GlooCopyService` across clusters.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.resharding.copy_services.base import CopyService

__all__ = ["NixlCopyService"]

_MESSAGE = ("NixlCopyService needs the NIXL library (the 'nixl' package with its UCX backend and GPU "
            "memory registration), which this library does not integrate; use refit_method='gloo' "
            "(GlooCopyService) or 'nccl' (NCCLCopyService)")


class NixlCopyService(CopyService):
    """Megatron-Core's NIXL transport: unavailable here, constructing it raises ``ImportError``."""

    def __init__(self, group: Any = None, agent_name: str | None = None) -> None:
        raise ImportError(_MESSAGE)

    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int, task_id: int | None = None) -> None:
        """Unavailable (see the class)."""
        raise ImportError(_MESSAGE)

    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int, task_id: int | None = None) -> None:
        """Unavailable (see the class)."""
        raise ImportError(_MESSAGE)

    def run(self) -> None:
        """Unavailable (see the class)."""
        raise ImportError(_MESSAGE)
