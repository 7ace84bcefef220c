"""Validation of ``hybrid_context_parallel`` in ``TransformerConfig`` (Megatron's hybrid / dynamic context parallelism).

Megatron-LM's argument checks (Megatron-Core's own config accepts the flag silently): the loss is summed per
token (``calculate_per_token_loss``: sub-samples differ in length and count per rank, so only a token-count
normalisation is right) and CUDA graphs are off (the CP group changes between micro-batches). Pipeline
parallelism and ``max_seqlen_per_dp_cp_rank`` are checked by ``ModelParallelConfig``. Refused here as well,
because their communication uses the layer's fixed CP group rather than the sub-sample's: multi-latent
attention (Megatron-Core asserts at run time), multi-token prediction, the hierarchical ``a2a+p2p`` CP
communication and the experimental attention variants. Each rule raises a ``ValueError`` naming the fields.
"""

from __future__ import annotations

from typing import Any

__all__ = ["check_hybrid_context_parallel"]


def _comm_types(cfg: Any) -> list[Any]:
    value = cfg.cp_comm_type
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_hybrid_context_parallel(cfg: Any) -> None:
    """Raise ``ValueError`` when ``cfg.hybrid_context_parallel`` is combined with a setting it does not support."""
    if not cfg.hybrid_context_parallel:
        return
    if not cfg.calculate_per_token_loss:
        raise ValueError("hybrid_context_parallel=True needs calculate_per_token_loss=True (got False): sub-samples "
                         "differ in length and number per rank, so the loss is normalised by the token count")
    if cfg.enable_cuda_graph or cfg.cuda_graph_impl != "none":
        raise ValueError("hybrid_context_parallel=True is not supported with CUDA graphs (enable_cuda_graph="
                         f"{cfg.enable_cuda_graph}, cuda_graph_impl={cfg.cuda_graph_impl!r}): the CP group changes "
                         "between micro-batches")
    refused = {
        "multi_latent_attention": cfg.multi_latent_attention,
        "mtp_num_layers": cfg.mtp_num_layers,
        "experimental_attention_variant": getattr(cfg, "experimental_attention_variant", None),
    }
    for name, value in refused.items():
        if value:
            raise ValueError(f"hybrid_context_parallel=True is not supported with {name}={value!r}: its context-"
                             "parallel communication uses the layer's fixed CP group, not each sub-sample's")
    if "a2a+p2p" in _comm_types(cfg):
        raise ValueError(f"hybrid_context_parallel=True is not supported with cp_comm_type={cfg.cp_comm_type!r}: the "
                         "hierarchical groups of 'a2a+p2p' are fixed; use 'p2p', 'a2a' or 'all_gather'")
