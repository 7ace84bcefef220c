"""Temperature, top-k and top-p (nucleus) sampling in plain PyTorch (Megatron-Core's ``TorchSampling``).

Definitions (the reference the tests check against): logits are divided by ``temperature``;
top-k keeps the ``k`` largest logits (ties at the k-th value are kept); top-p keeps the smallest
prefix of the tokens sorted by probability whose cumulative probability reaches ``p`` (the first
token is always kept); everything else gets probability zero and the rest is renormalised.
``top_k == 1`` is the argmax, without randomness. Temperatures below ``MIN_TEMPERATURE`` (1e-6) count
as ``MIN_TEMPERATURE`` (smaller ones overflow float32 logits; the result is the argmax anyway). Draws use an explicit ``torch.Generator``, so a
fixed seed reproduces.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

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


class TorchSampling:
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
        buckets: dict[tuple[float, int, float], list[int]] = defaultdict(list)
        for row, p in enumerate(params):
            buckets[(float(p.temperature), int(p.top_k), float(p.top_p))].append(row)
        if len(buckets) == 1:  # every row alike (the usual case): no gather, no scatter
            (temperature, top_k, top_p), = buckets
            return sample_from_logits(logits, temperature, top_k, top_p, self._rng)
        out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
        for (temperature, top_k, top_p), rows in buckets.items():
            index = torch.tensor(rows)
            # From pinned memory the copy does not wait for the device (the engine overlaps decode steps).
            index = index.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else index
            out[index] = sample_from_logits(logits.index_select(0, index), temperature, top_k, top_p, self._rng)
        return out
