"""Routing overrides of Megatron-Core's MoE: random router logits for benchmarks, and padded routing maps.

- ``moe_router_force_load_balancing``: :func:`apply_random_logits` replaces the router's logits with
  standard-normal noise drawn from the expert-parallel RNG stream (different on every expert-parallel
  rank), so the experts receive tokens as evenly as random routing gives. The gradient passes straight
  through to the real logits (:class:`RandomSTE`), so the router still trains.
- ``moe_router_force_biased = std``: :func:`apply_biased_logits` does the same and then adds one bias per
  expert drawn from ``N(0, |std|)`` on the data-parallel RNG stream (identical on every rank): a skewed but
  reproducible load. A negative ``std`` draws the bias once per layer and reuses it.
- ``moe_router_padding_for_quantization``: :func:`pad_routing_map` adds routes to each expert until its
  token count is a multiple of :func:`get_align_size_for_quantization` (the FP8 GEMMs' row alignment).
  The added routes carry probability zero, so they change which rows the experts compute, not the output.

All three are benchmark or kernel-layout aids and exist so that configurations written for Megatron-Core
run unchanged. They are re-exported from :mod:`megatron_core.transformer.moe.moe_utils`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.tensor_parallel.random import (
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
)

__all__ = ["RandomSTE", "RandomSTEShared", "apply_biased_logits", "apply_random_logits",
           "get_align_size_for_quantization", "pad_routing_map"]

_FP8_ROW_ALIGNMENT = {"mxfp8": 32}  # every other FP8 recipe: 16 rows


class RandomSTE(torch.autograd.Function):
    """Random logits in the forward (expert-parallel RNG stream); the gradient passes straight through."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor) -> torch.Tensor:
        """Standard-normal values of ``logits``' shape and dtype."""
        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            return torch.empty_like(logits).normal_()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:
        """The gradient, unchanged."""
        return grad_output


def apply_random_logits(logits: torch.Tensor) -> torch.Tensor:
    """Standard-normal logits of ``logits``' shape, with a straight-through gradient (:class:`RandomSTE`)."""
    return RandomSTE.apply(logits)


class RandomSTEShared(torch.autograd.Function):
    """``logits + bias`` with ``bias [num_experts] ~ N(0, |std|)`` identical on every rank; straight-through.

    With ``std < 0`` the bias is drawn once per ``layer_number`` and kept in :attr:`cache`.
    """

    cache: dict[Any, torch.Tensor] = {}

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, std: float, layer_number: Any) -> torch.Tensor:
        """``logits`` plus the shared bias (drawn now, or taken from :attr:`cache` for a negative ``std``)."""
        reuse = std < 0 and layer_number is not None
        bias = RandomSTEShared.cache.get(layer_number) if reuse else None
        if bias is None or bias.device != logits.device or bias.dtype != logits.dtype:
            with get_cuda_rng_tracker().fork(get_data_parallel_rng_tracker_name()):
                bias = torch.empty(logits.shape[-1], device=logits.device, dtype=logits.dtype).normal_(std=abs(std))
            if reuse:
                RandomSTEShared.cache[layer_number] = bias
        return logits + bias

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor):
        """The gradient of ``logits``, unchanged."""
        return grad_output, None, None


def apply_biased_logits(logits: torch.Tensor, std: float, layer_number: Any = None) -> torch.Tensor:
    """Random logits (:func:`apply_random_logits`) plus a shared random bias per expert (:class:`RandomSTEShared`)."""
    return RandomSTEShared.apply(apply_random_logits(logits), std, layer_number)


def get_align_size_for_quantization(config: Any) -> int:
    """Rows each expert's token count is padded to a multiple of: 16 for FP8 (32 for ``mxfp8``), 0 without FP8."""
    if getattr(config, "fp8", None):
        return _FP8_ROW_ALIGNMENT.get(config.fp8_recipe, 16)
    return 0


@torch.compiler.disable
def pad_routing_map(routing_map: torch.Tensor, pad_multiple: int) -> torch.Tensor:
    """``routing_map [tokens, experts]`` with routes added so each expert's count is a multiple of ``pad_multiple``.

    Each expert gains the earliest tokens not yet routed to it. The input is not modified; the result is boolean.
    Runs eagerly inside compiled code: Inductor (torch 2.11) fails to generate this scan-and-mask kernel, and the
    dispatcher reads the padded counts on the host right after, which ends the graph there anyway.
    """
    if pad_multiple <= 1:
        return routing_map.bool()
    routed = routing_map.bool().t()  # [experts, tokens]: the scan runs along the last dimension
    free = ~routed
    missing = (-routed.sum(dim=1)) % pad_multiple  # [experts]
    free_rank = torch.cumsum(free.to(torch.int32), dim=1)  # 1-based rank among each expert's free tokens
    return (routed | (free & (free_rank <= missing.unsqueeze(1)))).t()
