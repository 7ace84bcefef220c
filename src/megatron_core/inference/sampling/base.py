"""``Sampling``: the interface of an inference sampling backend (Megatron-Core's ``inference.sampling.base``).

A backend implements two kernels over a step's logits: :meth:`Sampling.sample_kernel` draws one token per row
and :meth:`Sampling.log_probs_kernel` gives each row's log-probabilities under the distribution it samples
from. Both read each request's settings from the context's ``active_request_metadata`` (CPU tensors
``temperature``, ``top_k``, ``top_p`` indexed by active request; the first ``total_request_count -
paused_request_count`` are active). :meth:`Sampling.sample_speculative` lays out the rows of a
speculative-verify step (``1 + num_speculative_tokens`` per decode request, then one per prefill request)
and calls the sampling kernel.
"""

from __future__ import annotations

import abc
from typing import Any

import torch

__all__ = ["Sampling", "active_request_settings"]


def active_request_settings(context: Any) -> tuple[list[float], list[int], list[float]]:
    """``(temperatures, top_ks, top_ps)`` of the context's active requests, as Python lists."""
    active = context.total_request_count - context.paused_request_count
    metadata = context.active_request_metadata
    return (metadata["temperature"][:active].tolist(), metadata["top_k"][:active].tolist(),
            metadata["top_p"][:active].tolist())


class Sampling(abc.ABC):
    """Abstract inference sampling backend (see the module docstring)."""

    @abc.abstractmethod
    def sample_kernel(self, logits: torch.Tensor, n: int, context: Any, *, no_top_k: bool, no_top_p: bool,
                      gather_indices: torch.Tensor | None = None, token_to_request_index: torch.Tensor | None = None,
                      output: torch.Tensor | None = None, eager: bool = False, cache_key: Any = None) -> torch.Tensor:
        """Token ids ``[n]`` sampled from ``logits`` ``[>= n, V]``.

        Args:
            logits: the step's logits.
            n: how many rows to sample.
            context: the dynamic inference context (its ``active_request_metadata``).
            no_top_k, no_top_p: True when no active request uses top-k (top-p), so a backend may skip it.
            gather_indices: when given, row ``i`` is ``logits[gather_indices[i]]``; else ``logits[i]``.
            token_to_request_index: CPU ``[n]``, the request of each row; else row ``i`` is request ``i``.
            output: a ``[n]`` tensor to write the tokens into (and return).
            eager, cache_key: for backends that replay CUDA graphs.
        """

    @abc.abstractmethod
    def log_probs_kernel(self, logits: torch.Tensor, context: Any, *,
                         token_to_request_index: torch.Tensor | None = None) -> torch.Tensor:
        """Log-probabilities ``[rows, V]`` of the distribution each row is sampled from (filtered tokens ``-inf``);
        ``token_to_request_index`` (CPU) maps rows to requests, else row ``i`` is request ``i``."""

    def sample_speculative(self, required_logits: torch.Tensor, num_decode: int, num_prefill: int,
                           num_speculative_tokens: int, context: Any, *, gather_indices: torch.Tensor | None = None,
                           eager: bool = False, cache_key: Any = None) -> torch.Tensor:
        """Tokens for a speculative-verify step: ``1 + num_speculative_tokens`` rows per decode request (the
        first ``num_decode`` requests), then one row per prefill request; ``gather_indices`` as in
        :meth:`sample_kernel`, else ``required_logits`` holds exactly those rows."""
        rows_per_decode = 1 + num_speculative_tokens
        token_to_request_index = torch.cat([
            torch.arange(num_decode).repeat_interleave(rows_per_decode),
            torch.arange(num_decode, num_decode + num_prefill),
        ])
        _, top_k, top_p = active_request_settings(context)
        return self.sample_kernel(
            required_logits, num_decode * rows_per_decode + num_prefill, context,
            no_top_k=all(k == 0 for k in top_k), no_top_p=all(p == 0.0 for p in top_p),
            gather_indices=gather_indices, token_to_request_index=token_to_request_index, eager=True)
