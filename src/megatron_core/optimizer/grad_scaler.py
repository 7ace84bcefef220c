"""Loss scalers for fp16 training: ``ConstantGradScaler`` and ``DynamicGradScaler`` (Megatron-Core's).

The dynamic scaler halves the scale after ``hysteresis`` consecutive steps with an inf/nan
gradient (never below ``min_scale``) and doubles it after ``growth_interval`` clean steps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class MegatronGradScaler(ABC):
    """Base class: holds the current scale and its inverse."""

    def __init__(self, initial_scale: float) -> None:
        if initial_scale <= 0:
            raise ValueError(f"initial_scale ({initial_scale}) must be > 0")
        self._scale = torch.tensor([float(initial_scale)], dtype=torch.float32)

    @property
    def scale(self) -> torch.Tensor:
        """The current loss scale (a 1-element fp32 tensor)."""
        return self._scale

    @property
    def inv_scale(self) -> torch.Tensor:
        """1 / scale, as a float64-accurate fp32 tensor."""
        return self._scale.double().reciprocal().float()

    @abstractmethod
    def update(self, found_inf: bool) -> None:
        """Adjust the scale after a step (``found_inf``: the step was skipped)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`."""


class ConstantGradScaler(MegatronGradScaler):
    """A fixed loss scale."""

    def update(self, found_inf: bool) -> None:
        """Nothing changes."""

    def state_dict(self) -> dict[str, Any]:
        """Nothing to save."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore."""


class DynamicGradScaler(MegatronGradScaler):
    """Back off on inf/nan (after ``hysteresis`` hits), grow after ``growth_interval`` clean steps."""

    def __init__(self, initial_scale: float, min_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, hysteresis: int) -> None:
        super().__init__(initial_scale)
        if not 0.0 < min_scale <= initial_scale:
            raise ValueError(f"min_scale ({min_scale}) must be in (0, initial_scale ({initial_scale})]")
        if growth_factor <= 1.0:
            raise ValueError(f"growth_factor ({growth_factor}) must be > 1")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor ({backoff_factor}) must be in (0, 1)")
        if growth_interval <= 0 or hysteresis <= 0:
            raise ValueError(f"growth_interval ({growth_interval}) and hysteresis ({hysteresis}) must be > 0")
        self.min_scale = torch.tensor([float(min_scale)], dtype=torch.float32)
        self.growth_factor = torch.tensor([float(growth_factor)], dtype=torch.float32)
        self.backoff_factor = torch.tensor([float(backoff_factor)], dtype=torch.float32)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Track clean and overflowing steps and change the scale accordingly."""
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = torch.max(self._scale * self.backoff_factor, self.min_scale)
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._growth_tracker = 0
                self._hysteresis_tracker = self.hysteresis
                self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Scale and trackers (Megatron-Core's keys)."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "hysteresis_tracker": self._hysteresis_tracker}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore scale and trackers."""
        self._scale = state_dict["scale"].float().cpu()
        self._growth_tracker = int(state_dict["growth_tracker"])
        self._hysteresis_tracker = int(state_dict["hysteresis_tracker"])
