"""Parallel layout of an exported model (Megatron-Core's ``export.export_config.ExportConfig``).

``use_embedding_sharing`` is deprecated (the exporter takes ``share_embeddings_and_output_weights``
instead): setting it to anything but ``None`` always emits a ``DeprecationWarning``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass


@dataclass
class ExportConfig:
    """Tensor/pipeline sizes the exported model will run with at inference, and embedding options."""

    inference_tp_size: int = 1
    """Tensor-parallel size of the inference engine."""

    inference_pp_size: int = 1
    """Pipeline-parallel size of the inference engine."""

    use_parallel_embedding: bool = False
    """Split the embedding table across the inference tensor-parallel ranks."""

    use_embedding_sharing: bool | None = None
    """Deprecated; ``None`` unless set."""

    def __post_init__(self) -> None:
        for name in ("inference_tp_size", "inference_pp_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ExportConfig.{name} ({value!r}) must be a positive integer")
        if self.use_embedding_sharing is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("always", DeprecationWarning)
                warnings.warn(
                    f"ExportConfig.use_embedding_sharing ({self.use_embedding_sharing!r}) is deprecated: "
                    "pass share_embeddings_and_output_weights to the exporter instead",
                    DeprecationWarning,
                    stacklevel=3,
                )
