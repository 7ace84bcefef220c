"""Mock multimodal samples: a GPT mock sample plus a blank image (Megatron-Core ``datasets.multimodal_dataset``).

:class:`MockMultimodalDataset` is :class:`~megatron_core.datasets.gpt_dataset.MockGPTDataset` whose
samples also hold ``"image"``, a zero ``[3, image_h, image_w]`` fp32 tensor, and then pass through the
config's ``preprocess_func`` (identity by default), which adapts a sample to a given model's inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset


def _identity(sample: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return sample


@dataclass
class MultimodalDatasetConfig(GPTDatasetConfig):
    """``GPTDatasetConfig`` plus the mock image size (both required) and a per-sample preprocessing function."""

    image_h: int | None = None
    """Image height."""

    image_w: int | None = None
    """Image width."""

    preprocess_func: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = _identity
    """Maps each sample dict to the format a model expects; identity by default."""

    def __post_init__(self) -> None:
        super().__post_init__()
        missing = [name for name in ("image_h", "image_w") if getattr(self, name) is None]
        if missing:
            raise ValueError(f"MultimodalDatasetConfig: {', '.join(missing)} must be set")


class MockMultimodalDataset(MockGPTDataset):
    """Mock GPT samples with a zero image of the config's size, passed through ``config.preprocess_func``."""

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        """The mock text sample ``idx`` plus ``"image"`` (``[3, image_h, image_w]`` zeros, fp32)."""
        sample = super().__getitem__(idx)
        sample["image"] = torch.zeros((3, self.config.image_h, self.config.image_w), dtype=torch.float32)
        return self.config.preprocess_func(sample)
