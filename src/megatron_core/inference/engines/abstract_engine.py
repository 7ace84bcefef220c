"""Base class of the inference engines (Megatron-Core's ``AbstractEngine``)."""

from __future__ import annotations

import abc
from typing import Any


class AbstractEngine(abc.ABC):
    """An engine turns prompts into finished requests."""

    @abc.abstractmethod
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """Serve prompts to completion."""
