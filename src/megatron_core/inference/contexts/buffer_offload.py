"""Releasing and restoring the dynamic context's large buffers while its engine is suspended (Megatron-Core's
``DynamicInferenceContext.deallocate_inference_state_buffers`` / ``reinitialize_inference_state_buffers``).

The large buffers are the per-layer KV buffers (``kv_memory``) and, for a hybrid model, the Mamba convolution and
SSM states (:class:`~.mamba_states.MambaStateSlots`). ``InferenceConfig.kv_cache_management_mode`` says what a
suspend does with them:

- ``PERSIST``: nothing moves; requests continue where they were.
- ``OFFLOAD``: each buffer is copied to host memory (pinned when it lives on a GPU) and the device tensor dropped;
  reinitializing copies it back into a new device tensor. Requests keep their blocks and slots and continue
  exactly where they were.
- ``RECOMPUTE``: the buffers are dropped (only their shapes are kept); reinitializing allocates zeroed ones and
  forgets every request and the prefix cache. The engine re-queues its requests to prefill their prompt and the
  tokens generated so far again.

With OFFLOAD and RECOMPUTE the buffers come back at new addresses, so CUDA graphs captured over the old ones are
stale: the engine drops them. Buffers that were never allocated (no forward yet) are allocated on first use, as
before. While deallocated, in every mode, a call that would touch the context's tensors raises
:class:`~.overflow_errors.TensorStateDeallocatedError` naming the call; bookkeeping that touches no tensor
(releasing or cancelling a request) still works.

Dropping a tensor hands its memory back to PyTorch's caching allocator (as Megatron-Core's storage resize does), so
other work in the process (training) reuses it; ``torch.cuda.empty_cache()`` returns it to the driver.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.inference.config import KVCacheManagementMode
from megatron_core.inference.contexts.overflow_errors import TensorStateDeallocatedError

__all__ = ["InferenceStateBuffers", "ReleasedBuffer", "release_tensors", "restore_tensors", "synchronize_devices"]


@dataclass
class ReleasedBuffer:
    """What is kept of a dropped buffer: its shape, dtype and device, and its contents on the host (or ``None``)."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    host_copy: torch.Tensor | None

    @classmethod
    def release(cls, tensor: torch.Tensor, keep_data: bool) -> ReleasedBuffer:
        """Describe ``tensor``; with ``keep_data`` copy it to host memory (pinned for a CUDA tensor)."""
        host_copy = None
        if keep_data:
            host_copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            host_copy.copy_(tensor, non_blocking=tensor.is_cuda)
        return cls(tensor.shape, tensor.dtype, tensor.device, host_copy)

    def restore(self) -> torch.Tensor:
        """A new tensor on the original device: the host copy's contents, or zeros when none was kept."""
        if self.host_copy is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        tensor.copy_(self.host_copy, non_blocking=self.device.type == "cuda")
        return tensor


def release_tensors(buffers: dict[Any, torch.Tensor], keep_data: bool) -> dict[Any, ReleasedBuffer]:
    """Empty ``buffers`` (the caller's references are the last ones); returns what :func:`restore_tensors` needs."""
    released = {key: ReleasedBuffer.release(tensor, keep_data) for key, tensor in buffers.items()}
    buffers.clear()
    return released


def restore_tensors(released: dict[Any, ReleasedBuffer]) -> dict[Any, torch.Tensor]:
    """The tensors :func:`release_tensors` released, by key, on their devices."""
    return {key: buffer.restore() for key, buffer in released.items()}


def synchronize_devices(devices: Iterable[torch.device]) -> None:
    """Wait for the copies queued on any CUDA device of ``devices`` (host copies complete, memory reusable)."""
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)


class InferenceStateBuffers:
    """Suspend-time release and restore of the dynamic context's KV buffers and Mamba states (a mixin: the
    context's ``__init__`` calls :meth:`_init_state_buffers`)."""

    kv_memory: dict[int, tuple[torch.Tensor, torch.Tensor]]
    mamba_slots: Any
    mtp_decoder_hidden_states: torch.Tensor | None

    def _init_state_buffers(self, mode: KVCacheManagementMode) -> None:
        self.kv_cache_management_mode = KVCacheManagementMode(mode)
        self.is_tensor_state_allocated = True
        self._released_kv: dict[tuple[int, int], ReleasedBuffer] = {}

    def check_tensor_state_allocated(self, call: str, request_id: Any = None) -> None:
        """Raise :class:`TensorStateDeallocatedError` naming ``call`` while the buffers are deallocated."""
        if not self.is_tensor_state_allocated:
            raise TensorStateDeallocatedError(
                request_id, f"{call}: the context's tensor state is deallocated (the engine is suspended, "
                f"kv_cache_management_mode={self.kv_cache_management_mode.value}); call "
                "reinitialize_inference_state_buffers() (engine.resume()) first")

    def deallocate_inference_state_buffers(self) -> None:
        """Release the KV buffers and Mamba states as ``kv_cache_management_mode`` says (idempotent)."""
        if not self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = False
        if self.kv_cache_management_mode == KVCacheManagementMode.PERSIST:
            return
        keep = self.kv_cache_management_mode == KVCacheManagementMode.OFFLOAD
        flat = {(layer, i): tensor for layer, pair in self.kv_memory.items() for i, tensor in enumerate(pair)}
        self.kv_memory.clear()
        self._released_kv = release_tensors(flat, keep)
        devices = [buffer.device for buffer in self._released_kv.values()]
        if self.mamba_slots is not None:
            devices += self.mamba_slots.release_buffers(keep)
        self.mtp_decoder_hidden_states = None
        synchronize_devices(devices)

    def reinitialize_inference_state_buffers(self) -> None:
        """Bring the buffers back after :meth:`deallocate_inference_state_buffers` (idempotent).

        RECOMPUTE also forgets every request and the prefix cache (:meth:`reset`): their KV is gone.
        """
        if self.is_tensor_state_allocated:
            return
        self.is_tensor_state_allocated = True
        if self.kv_cache_management_mode == KVCacheManagementMode.PERSIST:
            return
        restored = restore_tensors(self._released_kv)
        self.kv_memory.update({layer: (restored[(layer, 0)], restored[(layer, 1)])
                               for layer in sorted({layer for layer, _ in restored})})
        devices = [tensor.device for tensor in restored.values()]
        self._released_kv = {}
        if self.mamba_slots is not None:
            devices += self.mamba_slots.restore_buffers()
        synchronize_devices(devices)
        if self.kv_cache_management_mode == KVCacheManagementMode.RECOMPUTE:
            self.reset()
