"""Temperature, top-k and top-p (nucleus) sampling in plain PyTorch (Megatron-Core's ``TorchSampling``).

Definitions (the reference the tests check against): logits are divided by ``temperature``;
top-k keeps the ``k`` largest logits (ties at the k-th value are kept); top-p keeps the smallest
prefix of the tokens sorted by probability whose cumulative probability reaches ``p`` (the first
token is always kept); everything else gets probability zero and the rest is renormalised.
``top_k == 1`` is the argmax, without randomness. Temperatures below ``MIN_TEMPERATURE`` (1e-6) count
as ``MIN_TEMPERATURE`` (smaller ones overflow float32 logits; the result is the argmax anyway). Draws use an explicit ``torch.Generator``, so a
fixed seed reproduces.

:class:`TorchSampling` is a :class:`~.base.Sampling` backend: the engine's controller calls :meth:`TorchSampling.sample`
with one ``SamplingParams`` per row; Megatron-Core's kernels (:meth:`~TorchSampling.sample_kernel`,
:meth:`~TorchSampling.log_probs_kernel`) take each row's settings from a context's ``active_request_metadata``.
Both group rows by ``(temperature, top_k, top_p)`` the same way.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch

from megatron_core.inference.sampling.base import Sampling, active_request_settings
from megatron_core.inference.sampling_params import SamplingParams

__all__ = ["MIN_TEMPERATURE", "filter_logits", "sample_from_logits", "TorchSampling"]

MIN_TEMPERATURE = 1e-6


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """A new ``[n, V]`` tensor: temperature-scaled, with tokens outside top-k / top-p set to ``-inf``."""
    if top_k > 0 and top_p > 0.0:
        raise ValueError(f"top_k ({top_k}) and top_p ({top_p}) cannot both be greater than zero")
    temperature = max(temperature, MIN_TEMPERATURE)  # a smaller one would overflow the scaled logits to inf
    out = logits.float() / temperature if temperature != 1.0 else logits.float().clone()
    if top_k > 0:
        if top_k > out.shape[-1]:
            raise ValueError(f"top_k ({top_k}) is larger than the vocabulary ({out.shape[-1]})")
        kth = torch.topk(out, top_k, dim=-1).values[..., -1:]
        out.masked_fill_(out < kth, float("-inf"))
    elif 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative > top_p
        drop[..., 1:] = drop[..., :-1].clone()  # keep the token that crosses p
        drop[..., 0] = False
        out.masked_fill_(drop.scatter(-1, order, drop), float("-inf"))
    return out


def sample_from_logits(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One token id per row of ``logits`` ``[n, V]``."""
    if top_k == 1:
        return torch.argmax(logits, dim=-1)
    probs = filter_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).view(-1)


Settings = tuple[float, int, float]  # (temperature, top_k, top_p) of a row


def _buckets(settings: Sequence[Settings]) -> dict[Settings, list[int]]:
    """Rows grouped by their settings, in order of first appearance."""
    buckets: dict[Settings, list[int]] = defaultdict(list)
    for row, key in enumerate(settings):
        buckets[key].append(row)
    return buckets


def _row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    index = torch.tensor(rows)
    # From pinned memory the copy does not wait for the device (the engine overlaps decode steps).
    return index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index


class TorchSampling(Sampling):
    """Samples rows with per-row settings, one launch per distinct ``(temperature, top_k, top_p)``."""

    def __init__(self, rng: torch.Generator, vocab_size: int | None = None) -> None:
        self._rng = rng
        self._vocab_size = vocab_size

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Token ids ``[n]`` for ``logits`` ``[n, V]`` and one :class:`SamplingParams` per row."""
        if self._vocab_size is not None:
            logits = logits[:, : self._vocab_size]
        first = params[0] if params else None
        if first is not None and all(p is first for p in params):  # one settings object for every row
            return sample_from_logits(logits, float(first.temperature), int(first.top_k), float(first.top_p),
                                      self._rng)
        return self._sample_rows(logits, [(float(p.temperature), int(p.top_k), float(p.top_p)) for p in params])

    def _sample_rows(self, logits: torch.Tensor, settings: Sequence[Settings]) -> torch.Tensor:
        """Token ids ``[n]`` for ``logits`` ``[n, V]`` (already cut to the vocabulary), row ``i`` with ``settings[i]``."""
        buckets = _buckets(settings)
        if len(buckets) == 1:  # every row alike (the usual case): no gather, no scatter
            (temperature, top_k, top_p), = buckets
            return sample_from_logits(logits, temperature, top_k, top_p, self._rng)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for (temperature, top_k, top_p), rows in buckets.items():
            index = _row_index(rows, logits.device)
            out[index] = sample_from_logits(logits.index_select(0, index), temperature, top_k, top_p, self._rng)
        return out

    def _row_settings(self, context: Any, token_to_request_index: torch.Tensor | None, rows: int) -> list[Settings]:
        temperature, top_k, top_p = active_request_settings(context)
        requests = range(rows) if token_to_request_index is None else token_to_request_index.tolist()
        return [(float(temperature[r]), int(top_k[r]), float(top_p[r])) for r in requests]

    def sample_kernel(self, logits: torch.Tensor, n: int, context: Any, *, no_top_k: bool, no_top_p: bool,
                      gather_indices: torch.Tensor | None = None, token_to_request_index: torch.Tensor | None = None,
                      output: torch.Tensor | None = None, eager: bool = False, cache_key: Any = None) -> torch.Tensor:
        """Token ids ``[n]`` with each row's request settings from the context (see :meth:`Sampling.sample_kernel`);
        ``no_top_k`` / ``no_top_p`` / ``eager`` / ``cache_key`` change nothing here."""
        rows = logits[gather_indices[:n]] if gather_indices is not None else logits[:n]
        if self._vocab_size is not None:
            rows = rows[:, : self._vocab_size]
        tokens = self._sample_rows(rows, self._row_settings(context, token_to_request_index, n))
        if output is None:
            return tokens
        output.copy_(tokens)
        return output

    def log_probs_kernel(self, logits: torch.Tensor, context: Any, *,
                         token_to_request_index: torch.Tensor | None = None) -> torch.Tensor:
        """``log_softmax`` of each row after its temperature and top-k / top-p filter (see :func:`filter_logits`)."""
        if self._vocab_size is not None:
            logits = logits[:, : self._vocab_size]
        out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
        settings = self._row_settings(context, token_to_request_index, logits.shape[0])
        for (temperature, top_k, top_p), rows in _buckets(settings).items():
            index = _row_index(rows, logits.device)
            filtered = filter_logits(logits.index_select(0, index), temperature, top_k, top_p)
            out[index] = torch.log_softmax(filtered, dim=-1)
        return out
