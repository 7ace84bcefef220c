"""Format-conversion hooks for resharding: a :class:`ReshardTransform` takes over chosen tensors' transfers.

For a tensor it claims, the executor sends what :meth:`ReshardTransform.prepare_send` returns, receives into
:meth:`ReshardTransform.prepare_recv`'s buffers (same count) and lets
:meth:`ReshardTransform.finalize_recv` write the result. Megatron-Core's ``MXFP8ReshardTransform`` (FlashInfer
MXFP8 persistent buffers) is not available in this library.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MXFP8ReshardTransform", "ReshardTransform"]


class ReshardTransform:
    """Base hook: claims no tensor; subclasses override the four methods."""

    def should_transform(self, param_name: str) -> bool:
        """True when ``param_name``'s transfers go through this transform."""
        return False

    def prepare_send(self, param_name: str, src_slice: tuple[slice, ...],
                     src_param: torch.nn.Parameter) -> list[torch.Tensor]:
        """The tensor(s) to send for ``src_param[src_slice]``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement prepare_send")

    def prepare_recv(self, param_name: str, dst_slice: tuple[slice, ...]) -> list[torch.Tensor]:
        """Receive buffers for ``dst_slice``, as many as ``prepare_send`` returns."""
        raise NotImplementedError(f"{type(self).__name__} does not implement prepare_recv")

    def finalize_recv(self, param_name: str, dst_slice: tuple[slice, ...],
                      recv_buffers: list[torch.Tensor]) -> None:
        """Write the received buffers into the destination."""
        raise NotImplementedError(f"{type(self).__name__} does not implement finalize_recv")


class MXFP8ReshardTransform(ReshardTransform):
    """Megatron-Core's MXFP8 refit transform: unavailable here, constructing it raises ``ImportError``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError(
            "MXFP8ReshardTransform needs FlashInfer MXFP8 inference weights (MXFP8Tensor persistent buffers of "
            "the 'inference_optimized' transformer_impl), which this library does not provide")
