"""What the engine asks of one dynamic-context step for one request (the scheduler's output, the layout's input).

The engine's scheduler builds one :class:`StepEntry` per request it runs in a step;
:meth:`~.step_layout.StepLayout.initialize_attention_state` lays the entries out and fills each one's
``logit_rows``, the rows the text-generation controller samples from and takes log-probs of.
``dynamic_context`` (Megatron-Core's module) re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["StepEntry"]


@dataclass
class StepEntry:
    """The tokens one request feeds in a step.

    ``start`` is the position of ``tokens[0]`` (= the number of the request's tokens already in the
    cache). ``sample``: the chunk reaches the end of the sequence, so a next token is sampled from
    its last logits row. ``all_logits``: materialize logits for every token (prompt log-probs);
    ``next_token`` is then the token after the chunk when the chunk does not end the sequence.
    ``draft_tokens``: speculative decoding: the last ``draft_tokens`` of ``tokens`` are MTP drafts to
    verify, so every token gets a logits row.
    The context fills ``logit_rows`` (the rows of this entry in the step's logits).
    """

    request_id: Any
    tokens: list[int]
    start: int
    sample: bool = True
    all_logits: bool = False
    next_token: int | None = None
    draft_tokens: int = 0
    logit_rows: list[int] = field(default_factory=list)
