"""Shard LLaVA's combined sequence for sequence and context parallelism (``_process_embedding_token_parallel``).

The combined sequence (text + image embeddings) is padded to the multiple that SP / CP need (padding
labels ``IGNORE_INDEX``, loss mask 0); with CP each rank keeps its two load-balanced chunks of the
embeddings ``[b, s, h]``, labels and loss mask (per document for packed ``"thd"`` batches) and the
embeddings become ``[s/cp, b, h]``; with SP the embeddings are then scattered over the TP group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core import tensor_parallel
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.models.multimodal._token_splice import IGNORE_INDEX
from megatron_core.models.multimodal.context_parallel import get_padding
from megatron_core.transformer.context_parallel_batch import get_batch_on_this_cp_rank


def pad_combined(embeddings: torch.Tensor | None, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
                 seq_dim: int, pad: int) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Append ``pad`` positions: zero embeddings (along ``seq_dim``), ignored labels, masked-out loss."""
    if pad:
        if embeddings is not None:
            embeddings = F.pad(embeddings, [0, 0] * (embeddings.dim() - 1 - seq_dim) + [0, pad])
        if labels is not None:
            labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)
            loss_mask = F.pad(loss_mask, (0, pad), value=0)
    return embeddings, labels, loss_mask


def split_for_context_parallel(batch: dict[str, torch.Tensor], packed_seq_params: Any, cp_group: Any) -> dict:
    """This CP rank's load-balanced chunks of every ``[b, s, ...]`` tensor in ``batch`` (split along dim 1)."""
    if packed_seq_params is None or packed_seq_params.qkv_format in (None, "sbhd"):
        return get_batch_on_this_cp_rank(batch, cp_group=cp_group)
    from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices

    reference = next(iter(batch.values()))
    layout = thd_layout(packed_seq_params, reference.shape[1])
    index = torch.tensor(thd_partitioned_indices(layout, get_pg_size(cp_group), get_pg_rank(cp_group)),
                         device=reference.device)
    return {key: value.index_select(1, index) for key, value in batch.items()}


def shard_combined_sequence(
    embeddings: torch.Tensor | None, labels: torch.Tensor | None, loss_mask: torch.Tensor | None,
    packed_seq_params: Any, *, sequence_parallel: bool, tp_size: int, tp_group: Any, cp_group: Any,
    required_length: int | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Pad and shard this stage's combined sequence (embeddings ``[s, b, h]``, or ``[b, s, h]`` with CP).

    ``required_length``: the exact padded length TP communication overlap needs (``ValueError`` otherwise).
    """
    cp = get_pg_size(cp_group)
    seq_dim = 1 if cp > 1 else 0
    length = embeddings.shape[seq_dim] if embeddings is not None else labels.shape[1] if labels is not None else None
    if length is not None:
        pad = get_padding(length, cp, tp_size, sequence_parallel)
        embeddings, labels, loss_mask = pad_combined(embeddings, labels, loss_mask, seq_dim, pad)
        if required_length is not None and length + pad != required_length:
            raise ValueError(f"sequence parallelism with tp_comm_overlap needs the combined sequence ({length + pad} "
                             f"tokens after padding) to be exactly language_max_sequence_length ({required_length})")
    if cp > 1:
        batch = {"embeddings": embeddings, "labels": labels, "loss_mask": loss_mask}
        batch = split_for_context_parallel({k: v for k, v in batch.items() if v is not None}, packed_seq_params,
                                           cp_group)
        embeddings, labels, loss_mask = batch.get("embeddings"), batch.get("labels"), batch.get("loss_mask")
        if embeddings is not None:
            embeddings = embeddings.transpose(0, 1).contiguous()  # [b, s/cp, h] -> [s/cp, b, h]
    if sequence_parallel and embeddings is not None:
        embeddings = tensor_parallel.scatter_to_sequence_parallel_region(embeddings, group=tp_group)
    return embeddings, labels, loss_mask
