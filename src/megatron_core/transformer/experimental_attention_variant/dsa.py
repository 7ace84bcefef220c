"""DeepSeek sparse attention (DeepSeek-V3.2; Megatron-Core's ``transformer.experimental_attention_variant.dsa``).

This module gathers Megatron-Core's public DSA names, which live in small modules here: the indexer
(:mod:`.dsa_indexer`), the sparse core attention and the top-k sharing rule (:mod:`.dsa_attention`), the
indexer's KL loss and its auto-scaler (:mod:`.dsa_indexer_loss`), the loss logging (:mod:`.dsa_loss_logging`),
the masks (:mod:`.dsa_masking`) and the token layout under context parallelism and packing (:mod:`.dsa_layout`). The model spec is
:func:`~megatron_core.models.gpt.experimental_attention_variant_module_specs.get_dsa_module_spec_for_backend`.
"""

from __future__ import annotations

from megatron_core.transformer.experimental_attention_variant.dsa_attention import (
    DSAttention,
    DSAttentionSubmodules,
    is_dsa_skip_topk_layer,
    source_dsa_compute_layer,
    unfused_dsa_fn,
)
from megatron_core.transformer.experimental_attention_variant.dsa_indexer import (
    DSAIndexer,
    DSAIndexerSubmodules,
    fused_qk_topk_naive,
    rotate_activation,
)
from megatron_core.transformer.experimental_attention_variant.dsa_indexer_loss import (
    DSAIndexerLossAutoScaler,
    compute_dsa_indexer_loss,
)
from megatron_core.transformer.experimental_attention_variant.dsa_loss_logging import (
    DSAIndexerLossLoggingHelper,
)

__all__ = [
    "DSAIndexer",
    "DSAIndexerLossAutoScaler",
    "DSAIndexerLossLoggingHelper",
    "DSAIndexerSubmodules",
    "DSAttention",
    "DSAttentionSubmodules",
    "compute_dsa_indexer_loss",
    "fused_qk_topk_naive",
    "is_dsa_skip_topk_layer",
    "rotate_activation",
    "source_dsa_compute_layer",
    "unfused_dsa_fn",
]
