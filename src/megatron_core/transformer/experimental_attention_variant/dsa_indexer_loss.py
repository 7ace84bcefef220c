"""The DSA indexer's KL loss (Megatron-Core's ``dsa_indexer_loss`` helpers and ``dsa.compute_dsa_indexer_loss``).

The indexer is trained to predict where the main attention looks: per query row, the target is the main
attention's probabilities summed over all heads (all TP ranks' heads: the sum is all-reduced over TP) and
L1-normalised; the prediction is the softmax of the index scores. The loss is ``KL(target || prediction)``
summed over keys, averaged over query rows (summed with ``calculate_per_token_loss``), times
``dsa_indexer_loss_coeff``. With ``sparse_loss`` both distributions are restricted to the selected keys. The
main attention's query and key are detached, so the loss trains the indexer only.

:class:`DSAIndexerLossAutoScaler` attaches the loss to the attention output: the forward returns the output
unchanged, the backward passes its gradient through and gives the loss the gradient
``main_loss_backward_scale`` (which the schedules set from the main loss's scale, as for MoE's aux losses).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron_core.transformer.experimental_attention_variant import dsa_masking
from megatron_core.transformer.experimental_attention_variant.dsa_layout import ensure_sbhd
from megatron_core.transformer.loss_auto_scaler import LossAutoScaler

__all__ = [
    "INDEXER_LOSS_EPS",
    "DSAIndexerLossAutoScaler",
    "compute_dsa_indexer_loss",
    "indexer_kl_per_row",
    "indexer_loss_from_target",
    "normalize_indexer_target",
]

INDEXER_LOSS_EPS = 1e-10


def normalize_indexer_target(target: torch.Tensor) -> torch.Tensor:
    """``target`` (non-negative) divided by its sum over the last (key) dimension; all-zero rows stay zero."""
    return target / target.sum(dim=-1, keepdim=True).clamp_min(INDEXER_LOSS_EPS)


def indexer_kl_per_row(target: torch.Tensor, predict_log_probs: torch.Tensor,
                       valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``KL(target || predict)`` per row (summed over the last dimension), entries outside ``valid_mask`` skipped."""
    terms = target * (torch.log(target.clamp_min(INDEXER_LOSS_EPS)) - predict_log_probs)
    if valid_mask is not None:
        terms = terms.masked_fill(~valid_mask, 0.0)
    return terms.sum(dim=-1)


def indexer_loss_from_target(target: torch.Tensor, predict_log_probs: torch.Tensor, loss_coeff: float,
                             query_valid_rows: torch.Tensor | None = None, calculate_per_token_loss: bool = False,
                             valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``loss_coeff`` times the KL summed over rows, divided by the number of (valid) rows unless
    ``calculate_per_token_loss``."""
    kl = indexer_kl_per_row(target, predict_log_probs, valid_mask)
    rows: torch.Tensor | float = float(max(kl.numel(), 1))
    if query_valid_rows is not None:
        row_mask = query_valid_rows.to(dtype=torch.float32, device=kl.device)
        kl = kl * row_mask
        rows = row_mask.sum().clamp_min(1.0)
    total = kl.sum()
    return (total if calculate_per_token_loss else total / rows) * loss_coeff


def compute_dsa_indexer_loss(
    index_scores: torch.Tensor,
    topk_indices: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    softmax_scale: float,
    loss_coeff: float,
    sparse_loss: bool,
    pg_collection: Any,
    mask: torch.Tensor | None = None,
    varlen_starts: torch.Tensor | None = None,
    varlen_ends: torch.Tensor | None = None,
    key_positions: torch.Tensor | None = None,
    query_valid_rows: torch.Tensor | None = None,
    calculate_per_token_loss: bool = False,
) -> torch.Tensor:
    """The indexer KL loss (a scalar) of ``index_scores`` ``[b, sq, sk]`` against the main attention.

    ``query`` ``[sq, b, np, hn]`` and ``key`` ``[sk, b, np, hn]`` are this rank's heads (no gradient flows into
    them; packed ``[t, np, hn]`` is read as ``[t, 1, np, hn]``); ``mask`` is the additive ``[sq, sk]`` /
    ``[b, sq, sk]`` mask (None: causal), or the row-wise key bounds ``varlen_starts`` / ``varlen_ends`` over
    ``key_positions`` describe it (:mod:`.dsa_masking`); ``topk_indices`` ``[b, sq, topk]`` restrict both
    distributions with ``sparse_loss``; ``query_valid_rows`` (``[sq]`` / ``[b, sq]`` bool) limits the rows averaged
    over. Gradients reach ``index_scores`` only.
    """
    query, _ = ensure_sbhd(query, "query")
    key, _ = ensure_sbhd(key, "key")
    sq, b, heads, _ = query.shape
    sk = key.shape[0]
    mask = dsa_masking.resolve_sparse_mask(mask, varlen_starts, varlen_ends, key_positions, sk=sk,
                                           device=index_scores.device)
    rows = dsa_masking.normalize_query_valid_rows(query_valid_rows, b=b, sq=sq, device=index_scores.device)
    _, attn_mask, index_mask_add, base_valid = dsa_masking.prepare_additive_mask(
        mask, sq=sq, sk=sk, b=b, device=index_scores.device)
    selected = torch.full((b, sq, sk), float("-inf"), dtype=torch.float32, device=index_scores.device)
    dsa_masking.scatter_topk_into_index_mask(selected, topk_indices)
    valid = base_valid & (selected == 0) if sparse_loss else base_valid
    with torch.no_grad():
        # [b, np, sq, sk]: the main attention's probabilities, summed over every TP rank's heads.
        scores = torch.einsum("sbnd,tbnd->bnst", query.detach().float(), key.detach().float()) * softmax_scale
        scores = scores + attn_mask
        if sparse_loss:
            scores = scores + selected.unsqueeze(1)
        probs = dsa_masking.masked_softmax(scores, valid.unsqueeze(1).expand(b, heads, sq, sk)).sum(dim=1)
        if get_pg_size(pg_collection.tp) > 1:
            probs = reduce_from_tensor_model_parallel_region(probs.contiguous(), group=pg_collection.tp)
        target = normalize_indexer_target(probs)
    predict = index_scores.float() + index_mask_add
    if sparse_loss:
        predict = predict + selected
    log_probs = dsa_masking.masked_log_softmax(predict, valid)
    return indexer_loss_from_target(target, log_probs, loss_coeff, query_valid_rows=rows,
                                    calculate_per_token_loss=calculate_per_token_loss)


class DSAIndexerLossAutoScaler(LossAutoScaler):
    """Attach the indexer loss to ``output`` so that its backward runs with the main loss's scale (default 1)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, indexer_loss: torch.Tensor) -> torch.Tensor:
        """Return ``output`` unchanged and keep ``indexer_loss`` for the backward (Megatron-Core's argument name)."""
        return LossAutoScaler.forward(ctx, output, indexer_loss)

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Set the scale of the indexer loss's gradient (the schedules call this each micro-batch).

        As in Megatron-Core: ``scale`` must be a tensor (else ``TypeError``); the first call stores it detached, later
        calls copy into the stored tensor in place.
        """
        if not isinstance(scale, torch.Tensor):
            raise TypeError("DSAIndexerLossAutoScaler.set_loss_scale requires a torch.Tensor")
        scale = scale.detach()
        if DSAIndexerLossAutoScaler.main_loss_backward_scale is None:
            DSAIndexerLossAutoScaler.main_loss_backward_scale = scale
        else:
            DSAIndexerLossAutoScaler.main_loss_backward_scale.copy_(scale)
