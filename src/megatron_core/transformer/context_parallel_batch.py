"""This context-parallel rank's part of a batch (Megatron-Core's ``utils.get_batch_on_this_cp_rank``).

Re-exported by ``megatron_core.utils``; packed (THD) batches use the layout of ``packed_sequences``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices

_CP_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


def _split_sequence_zigzag(key: str, val: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    seq_dim = 2 if key == "attention_mask" else 1
    length = val.shape[seq_dim]
    if length % (2 * cp_size) != 0:
        raise ValueError(
            f"get_batch_on_this_cp_rank: batch[{key!r}] has sequence length {length} (dim {seq_dim}), not "
            f"divisible by 2 * context_parallel_size ({2 * cp_size})"
        )
    val = val.view(*val.shape[:seq_dim], 2 * cp_size, length // (2 * cp_size), *val.shape[seq_dim + 1:])
    index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=val.device)
    val = val.index_select(seq_dim, index)
    return val.view(*val.shape[:seq_dim], -1, *val.shape[seq_dim + 2:])


def _split_whole_sequences(batch: dict[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    for key, val in list(batch.items()):
        if key in _CP_METADATA_KEYS or val is None:
            continue
        batch[key] = _split_sequence_zigzag(key, val, cp_size, cp_rank)
    return batch


def _hybrid_cp_split(batch: dict[str, Any], hybrid_cp_group_func: Callable | None) -> dict[str, Any]:
    """One hybrid-CP sub-sample: split over its own CP group of ``local_cp_size`` ranks (none for size 1)."""
    local_cp_size = batch.get("local_cp_size")
    if local_cp_size is None:
        raise ValueError("get_batch_on_this_cp_rank: is_hybrid_cp=True needs batch['local_cp_size'] (None); the "
                         "hybrid CP schedule adds it to every sub-sample")
    size = int(local_cp_size.item() if isinstance(local_cp_size, torch.Tensor) else local_cp_size)
    if size < 1:
        raise ValueError(f"get_batch_on_this_cp_rank: batch['local_cp_size'] ({size}) must be >= 1")
    if size == 1:
        return batch
    if hybrid_cp_group_func is None:
        raise ValueError(f"get_batch_on_this_cp_rank: is_hybrid_cp=True with local_cp_size {size} needs "
                         "hybrid_cp_group_func (e.g. parallel_state.get_hybrid_data_context_parallel_groups)")
    group = hybrid_cp_group_func(group_size=size)
    if get_pg_size(group) != size:
        raise ValueError(f"get_batch_on_this_cp_rank: hybrid_cp_group_func(group_size={size}) returned a group of "
                         f"{get_pg_size(group)} ranks")
    batch = _split_whole_sequences(batch, size, get_pg_rank(group))
    batch["hybrid_cp_group"] = group
    return batch


def get_batch_on_this_cp_rank(
    batch: dict[str, Any], is_hybrid_cp: bool = False, cp_group: Any = None,
    hybrid_cp_group_func: Callable | None = None, use_per_sequence_balancing: bool = False,
) -> dict[str, Any]:
    """This context-parallel rank's part of ``batch`` (Megatron's load-balanced split).

    Without ``cu_seqlens`` (or with ``use_per_sequence_balancing``) every tensor's sequence
    dimension (dim 1; dim 2 for ``attention_mask``) is cut into ``2 * cp`` chunks and CP rank ``r``
    keeps chunks ``r`` and ``2 * cp - 1 - r``. With ``cu_seqlens`` (packed documents) the same split
    is applied to every document (``cu_seqlens_padded`` if present) of ``tokens``, ``labels``,
    ``loss_mask`` and ``position_ids``. Metadata keys and ``None`` values are left as they are.
    The group is ``cp_group``, else ``parallel_state``'s CP group.

    Hybrid CP (``is_hybrid_cp`` with ``cu_seqlens``): the micro-batch is one sub-sample whose CP size is
    ``batch["local_cp_size"]``; above 1, ``hybrid_cp_group_func(group_size=local_cp_size)`` (e.g.
    ``parallel_state.get_hybrid_data_context_parallel_groups``) gives its group, the whole sequence is split
    as above over that group, and the group is stored as ``batch["hybrid_cp_group"]`` (for ``PackedSeqParams.cp_group``).
    """
    per_sequence = use_per_sequence_balancing or batch.get("cu_seqlens") is None
    if is_hybrid_cp and not per_sequence:
        return _hybrid_cp_split(batch, hybrid_cp_group_func)
    group = resolve_process_group("cp", group=cp_group)
    cp_size = get_pg_size(group)
    if cp_size == 1:
        return batch
    cp_rank = get_pg_rank(group)
    if per_sequence:
        return _split_whole_sequences(batch, cp_size, cp_rank)
    cu = batch.get("cu_seqlens_padded")
    cu = batch["cu_seqlens"] if cu is None else cu
    reference = batch.get("tokens") if batch.get("tokens") is not None else batch.get("labels")
    if reference is None:
        raise ValueError("get_batch_on_this_cp_rank: a packed batch needs 'tokens' or 'labels' to size the sequence")

    class _Cu:
        qkv_format = "thd"
        cu_seqlens_q = cu
        cu_seqlens_q_padded = None

    layout = thd_layout(_Cu(), reference.size(1))
    index = torch.tensor(thd_partitioned_indices(layout, cp_size, cp_rank), device=reference.device)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        if batch.get(key) is not None:
            batch[key] = batch[key].index_select(1, index)
    return batch
