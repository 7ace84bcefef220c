"""The process-wide "an inference engine is using the model" flag (Megatron-Core's ``inference.utils.InferenceMode``).

It lives in the ground layer so that layers below the engines (an MoE router or experts with an inference path)
can read it; ``megatron_core.inference.utils`` re-exports it at Megatron-Core's path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["InferenceMode"]


class InferenceMode:
    """Process-wide flag: True while an inference engine is using the model.

    The engines set it when they are built. Code that must tell inference from training (or from scoring
    log-probs) reads :meth:`is_active` rather than ``self.training`` or ``torch.is_grad_enabled()``.
    """

    _is_active: bool = False

    @classmethod
    def is_active(cls) -> bool:
        """Whether an inference engine is using the model."""
        return cls._is_active

    @classmethod
    def set_active(cls) -> None:
        """Mark an engine as using the model (idempotent)."""
        cls._is_active = True

    @classmethod
    def unset_active(cls) -> None:
        """Mark no engine as using the model (idempotent)."""
        cls._is_active = False

    @classmethod
    @contextlib.contextmanager
    def active(cls) -> Iterator[None]:
        """Set the flag for the duration of a ``with`` block (cleared afterwards, whatever it was before)."""
        cls.set_active()
        try:
            yield
        finally:
            cls.unset_active()
