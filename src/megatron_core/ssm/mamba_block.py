"""The hybrid layer stack at its pre-0.19 path; the code lives in
:mod:`megatron_core.models.hybrid.hybrid_block` (Megatron-Core 0.19 moved it there)."""

from megatron_core.models.hybrid.hybrid_block import *  # noqa: F403
from megatron_core.models.hybrid.hybrid_block import __all__ as __all__
