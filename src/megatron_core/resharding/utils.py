"""Records of the resharding planner: per-parameter metadata, transfer ops, plans, and tensor enumeration.

Every rank describes the tensors it holds as :class:`ParameterMetadata` (shape, dtype, TP/EP sharding,
group memberships, a canonical ``resolved_name``); the planner matches destination to source tensors by
``resolved_name`` and emits :class:`TransferOp` entries collected in a :class:`ReshardPlan`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from megatron_core.resharding._metadata import (
    assign_ep_resolved_name_inplace,
    assign_resolved_name_inplace,
    extract_param_metadata,
)
from megatron_core.resharding._records import ParameterMetadata, ReshardPlan, ShardingDescriptor, TransferOp

__all__ = [
    "ParameterMetadata",
    "ReshardPlan",
    "ShardingDescriptor",
    "TransferOp",
    "assign_ep_resolved_name_inplace",
    "assign_resolved_name_inplace",
    "extract_param_metadata",
    "get_refit_tensor_dict",
    "invalidate_refit_tensor_cache",
    "named_persistent_buffers",
    "named_refit_tensors",
    "select_src_metadata_balanced",
]


def named_persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str, torch.Tensor]]:
    """``(full_name, owning_module, buffer_name, tensor)`` for every buffer that ``state_dict`` saves."""
    for prefix, sub in module.named_modules():
        skip = sub._non_persistent_buffers_set
        for buf_name, buf in sub._buffers.items():
            if buf is None or buf_name in skip:
                continue
            yield (f"{prefix}.{buf_name}" if prefix else buf_name), sub, buf_name, buf


def named_refit_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter, then every persistent buffer, of ``module`` as ``(name, tensor)``: what a refit moves."""
    yield from module.named_parameters(recurse=True)
    for full_name, _sub, _name, buf in named_persistent_buffers(module):
        yield full_name, buf


_CACHE_ATTR = "_refit_tensor_cache"


def get_refit_tensor_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of :func:`named_refit_tensors`, built once and cached on ``module``."""
    cached: Any = getattr(module, _CACHE_ATTR, None)
    if cached is None:
        cached = dict(named_refit_tensors(module))
        setattr(module, _CACHE_ATTR, cached)
    return cached


def invalidate_refit_tensor_cache(module: torch.nn.Module) -> None:
    """Forget the cached tensor dict of ``module`` (after a buffer was replaced)."""
    if hasattr(module, _CACHE_ATTR):
        delattr(module, _CACHE_ATTR)


def select_src_metadata_balanced(src_meta_list: list[ParameterMetadata], dst_metadata: ParameterMetadata,
                                 dst_rank: int) -> ParameterMetadata:
    """The source replica that feeds ``dst_rank``: its own when it holds one (a local copy), else one chosen
    by ``dst_rank`` modulo the replicas (sorted by owner), which spreads readers over DP replicas."""
    if not src_meta_list:
        raise ValueError(f"no source replica for {dst_metadata.name!r} (destination rank {dst_rank})")
    for meta in src_meta_list:
        if meta.owner_rank == dst_rank:
            return meta
    ordered = sorted(src_meta_list, key=lambda m: m.owner_rank)
    return ordered[dst_rank % len(ordered)]
