"""Full activation recompute over a layer stack, at Megatron-Core's path ``megatron.core.recompute``.

The code lives in :mod:`megatron_core.transformer.full_recompute` (it runs transformer layers); this module
re-exports :func:`checkpointed_forward`, which ``TransformerBlock`` and ``HybridStack`` call.
"""

from megatron_core.transformer.full_recompute import checkpointed_forward

__all__ = ["checkpointed_forward"]
