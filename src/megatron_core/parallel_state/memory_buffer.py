"""A scratch-buffer pool keyed by name and dtype, reused across all-gathers (Megatron's GlobalMemoryBuffer)."""

from __future__ import annotations

import math

import torch


class GlobalMemoryBuffer:
    """Hands out views of a reusable flat buffer so that hot-path collectives do not allocate."""

    def __init__(self) -> None:
        self.buffer: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get_tensor(self, tensor_shape, dtype: torch.dtype, name: str, device=None) -> torch.Tensor:
        """A tensor of ``tensor_shape`` and ``dtype`` backed by the named buffer (grown as needed)."""
        from megatron_core.device import get_current_device

        device = torch.device(device) if device is not None else get_current_device()
        numel = math.prod(tensor_shape)
        key = (name, dtype, device)
        if key not in self.buffer or self.buffer[key].numel() < numel:
            self.buffer[key] = torch.empty(numel, dtype=dtype, device=device, requires_grad=False)
        return self.buffer[key][:numel].view(*tensor_shape)
