"""``MambaModel``: the deprecated name of :class:`~megatron_core.models.hybrid.hybrid_model.HybridModel`.

Megatron-Core 0.19 moved the model to ``models.hybrid``; this module re-exports it and keeps
``MambaModel``, which also accepts the old ``mamba_stack_spec`` keyword.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from megatron_core.models.hybrid.hybrid_model import HybridModel
from megatron_core.transformer.spec_utils import ModuleSpec

__all__ = ["HybridModel", "MambaModel"]

logger = logging.getLogger(__name__)


class MambaModel(HybridModel):
    """:class:`HybridModel` under its old name; ``mamba_stack_spec`` is the old name of ``hybrid_stack_spec``."""

    def __init__(self, *args: Any, mamba_stack_spec: ModuleSpec | None = None, **kwargs: Any) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("MambaModel is deprecated; use HybridModel instead")
        if mamba_stack_spec is not None:
            if "hybrid_stack_spec" in kwargs or len(args) >= 2:
                raise ValueError("hybrid_stack_spec and mamba_stack_spec cannot both be given "
                                 "(mamba_stack_spec is the deprecated name of hybrid_stack_spec)")
            kwargs["hybrid_stack_spec"] = mamba_stack_spec
        super().__init__(*args, **kwargs)
