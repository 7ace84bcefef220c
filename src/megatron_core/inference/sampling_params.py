"""Per-request sampling settings (Megatron-Core's ``inference.sampling_params.SamplingParams``).

``top_k = 0`` and ``top_p = 0.0`` mean "off"; ``top_k = 1`` is greedy decoding. Top-k and top-p
cannot both be on. ``num_tokens_to_generate = None`` generates until the termination token or
the context's ``max_sequence_length``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    return_log_probs: bool = False
    skip_prompt_log_probs: bool = False
    return_segments: bool = False
    num_tokens_to_generate: int | None = None
    num_tokens_total: int | None = None
    termination_id: int | None = None
    top_n_logprobs: int = 0
    return_prompt_top_n_logprobs: bool = False
    add_BOS: bool = False
    stop_words: list[str] | None = None
    detokenize_stop_sequence: bool = False
    return_prompt_tokens: bool = False

    def __post_init__(self) -> None:
        self.validate()
        if self.top_n_logprobs > 0:
            self.return_prompt_top_n_logprobs = not self.skip_prompt_log_probs

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field when a setting is out of range."""
        if (isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float))
                or not math.isfinite(self.temperature) or self.temperature <= 0.0):
            raise ValueError(f"SamplingParams.temperature ({self.temperature}) must be a finite number > 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k ({self.top_k}) must be an int >= 0 (0 = off, 1 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p ({self.top_p}) must be in [0, 1] (0 = off)")
        if self.top_k > 0 and self.top_p > 0.0:
            raise ValueError(
                f"SamplingParams: top_k ({self.top_k}) and top_p ({self.top_p}) cannot both be greater than zero"
            )
        if self.num_tokens_to_generate is not None and self.num_tokens_to_generate < 0:
            raise ValueError(
                f"SamplingParams.num_tokens_to_generate ({self.num_tokens_to_generate}) must be >= 0 or None"
            )
        if self.num_tokens_to_generate is not None and self.num_tokens_total is not None:
            raise ValueError("SamplingParams: set num_tokens_to_generate or num_tokens_total, not both")
        if self.top_n_logprobs < 0:
            raise ValueError(f"SamplingParams.top_n_logprobs ({self.top_n_logprobs}) must be >= 0")

    @property
    def is_greedy(self) -> bool:
        """Whether the next token is the argmax (``top_k == 1``)."""
        return self.top_k == 1

    def add_attributes(self, attribute_value_pair: dict[str, Any]) -> None:
        """Set extra (or existing) attributes from a dict, e.g. ``{"min_length": 4}``."""
        for key, value in attribute_value_pair.items():
            setattr(self, key, value)
        self.validate()

    def serialize(self) -> dict[str, Any]:
        """A plain-dict copy (JSON / msgpack friendly)."""
        return dict(self.__dict__)

    @classmethod
    def deserialize(cls, data: dict[str, Any]) -> SamplingParams:
        """Rebuild from :meth:`serialize`'s output (unknown keys become attributes)."""
        names = {f.name for f in fields(cls)}
        obj = cls(**{k: v for k, v in data.items() if k in names})
        obj.add_attributes({k: v for k, v in data.items() if k not in names})
        return obj
