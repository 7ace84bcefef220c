"""The NVLS step-metadata update of the inference MoE dispatchers (Megatron-Core's ``inference.moe.metadata``).

Megatron-Core's ``fused_metadata_update`` is one Triton kernel that multicast-stores this rank's token count
into an NVLS symmetric-memory buffer, waits on its signal pads and writes ``[valid_tokens, rank_token_offset,
ep_max_tokens]``. It exists only for :class:`~megatron_core.transformer.moe.token_dispatcher_inference.
NVLSAllGatherVDispatcher`, which this library refuses; the NCCL dispatcher computes the same numbers with a
plain all-gather of the counts. The function is kept under its name and raises, naming what is missing.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.transformer.moe.token_dispatcher_inference import NVLS_REFUSAL

__all__ = ["fused_metadata_update"]


def fused_metadata_update(local_tokens: int, local_buf: torch.Tensor, symm_mem_hdl: Any,
                          step_metadata: torch.Tensor) -> None:
    """Megatron-Core's fused NVLS metadata all-gather: raises ``NotImplementedError`` (see the module docstring)."""
    raise NotImplementedError(f"fused_metadata_update: {NVLS_REFUSAL}")
