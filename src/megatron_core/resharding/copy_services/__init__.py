"""Transports for resharding: a :class:`CopyService` runs a plan's point-to-point copies."""

from megatron_core.resharding.copy_services.base import CopyService
from megatron_core.resharding.copy_services.gloo_copy_service import GlooCopyService
from megatron_core.resharding.copy_services.nccl_copy_service import NCCLCopyService
from megatron_core.resharding.copy_services.nixl_copy_service import NixlCopyService
from megatron_core.resharding.copy_services.nvshmem_copy_service import NVSHMEMCopyService

__all__ = ["CopyService", "GlooCopyService", "NCCLCopyService", "NVSHMEMCopyService", "NixlCopyService"]
