"""``AudioModalitySubmodules``: audio encoders and at most one input and one output projection."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megatron_core.models.mimo.submodules.base import ModalitySubmodules


class AudioModalitySubmodules(ModalitySubmodules):
    """Audio modality of a MIMO model: encoders plus at most one input and one output projection."""

    def __init__(
        self,
        encoders: dict[str, nn.Module] | None = None,
        decoders: dict[str, nn.Module] | None = None,
        input_projections: list[nn.Module] | None = None,
        output_projections: list[nn.Module] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(encoders=encoders, decoders=decoders, input_projections=input_projections,
                         output_projections=output_projections, **kwargs)
        for kind, projections in (("input", self.input_projections), ("output", self.output_projections)):
            if len(projections) > 1:
                raise ValueError(f"AudioModalitySubmodules supports at most one {kind} projection, "
                                 f"got {len(projections)}")

    def decode(self, embeddings: torch.Tensor, data_batch: dict) -> torch.Tensor:
        """Audio decoding is not supported (as in Megatron-Core): raises ``NotImplementedError``."""
        raise NotImplementedError("AudioModalitySubmodules.decode: audio decoders are not supported")

__all__ = ["AudioModalitySubmodules"]
