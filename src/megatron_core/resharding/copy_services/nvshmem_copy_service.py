"""The NVSHMEM reshard transport (pipelined one-sided GPU puts) is not part of this library.

Megatron-Core's version compiles a CUDA kernel pipeline over the ``nvshmem`` Python bindings and a
symmetric GPU heap; constructing :class:`NVSHMEMCopyService` here raises ``ImportError`` saying so.
Use :class:`~megatron_core.resharding.copy_services.nccl_copy_service.NCCLCopyService` instead.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.resharding.copy_services.base import CopyService

__all__ = ["NVSHMEMCopyService"]

_MESSAGE = ("NVSHMEMCopyService needs NVIDIA NVSHMEM (the nvshmem4py bindings, a symmetric GPU heap on "
            "CUDA devices and Megatron-Core's CUDA copy kernels), which this library does not provide; use "
            "refit_method='nccl' (NCCLCopyService) or 'gloo' (GlooCopyService)")


class NVSHMEMCopyService(CopyService):
    """Megatron-Core's NVSHMEM transport: unavailable here, constructing it raises ``ImportError``."""

    def __init__(self, group: Any = None) -> None:
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
