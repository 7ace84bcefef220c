"""What one dynamic step produced per context step entry (:class:`DynamicStepOutput`), and top-n log-probs.

``text_generation_controller`` (Megatron-Core's module) re-exports :class:`DynamicStepOutput`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DynamicStepOutput", "chunk_log_probs", "top_n_log_probs"]


@dataclass
class DynamicStepOutput:
    """What one dynamic step produced, per context step entry (``None`` where nothing was asked).

    With speculative decoding, ``accepted_tokens`` holds each sampling entry's accepted drafts (emitted before
    its ``sampled_tokens`` entry, with their log-probs in ``accepted_log_probs`` / ``accepted_top_n``) and
    ``draft_tokens`` the MTP drafts to verify in the request's next step; without it these lists stay empty.
    """

    sampled_tokens: list[int | None] = field(default_factory=list)
    sampled_log_probs: list[float | None] = field(default_factory=list)
    sampled_top_n: list[list[tuple[int, float]] | None] = field(default_factory=list)
    chunk_log_probs: list[list[float] | None] = field(default_factory=list)
    chunk_top_n: list[list[list[tuple[int, float]]] | None] = field(default_factory=list)
    accepted_tokens: list[list[int] | None] = field(default_factory=list)
    accepted_log_probs: list[list[float] | None] = field(default_factory=list)
    accepted_top_n: list[list[list[tuple[int, float]] | None] | None] = field(default_factory=list)
    draft_tokens: list[list[int] | None] = field(default_factory=list)

    @classmethod
    def tokens_only(cls, sampled_tokens: list[int | None]) -> DynamicStepOutput:
        """The output of a step that asked for tokens and nothing else."""
        none = [None] * len(sampled_tokens)
        return cls(list(sampled_tokens), none, list(none), list(none), list(none))


def top_n_log_probs(row: torch.Tensor, n: int) -> list[tuple[int, float]] | None:
    """The ``n`` largest ``(token, log-prob)`` pairs of one log-prob ``row`` (None when ``n`` is 0)."""
    if n <= 0:
        return None
    values, ids = torch.topk(row, n)
    return list(zip(ids.tolist(), values.tolist()))


def chunk_log_probs(log_probs: torch.Tensor, entry: Any, top_n: int
                    ) -> tuple[list[float], list[list[tuple[int, float]] | None]]:
    """Log-probs (and top-n) of a prefill chunk's own tokens: each logit row of ``entry`` scored at the token that
    follows it (the chunk's next tokens, then ``entry.next_token`` when the chunk ends inside the prompt)."""
    rows = log_probs[entry.logit_rows]
    targets = entry.tokens[1:] + ([] if entry.next_token is None else [entry.next_token])
    return ([float(rows[i, t]) for i, t in enumerate(targets)],
            [top_n_log_probs(rows[i], top_n) for i in range(len(targets))])
