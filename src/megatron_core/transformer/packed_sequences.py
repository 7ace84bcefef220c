"""Host-side layout of packed ("THD") micro-batches: validation, RoPE positions and CP partitioning.

The document boundaries of a :class:`~megatron_core.packed_seq_params.PackedSeqParams` are read to
the host once per params object (one device->host copy per micro-batch, not per layer) and cached
on it. Every helper works in the *global* packed index space; under context parallelism each
document of padded length ``L`` (divisible by ``2 * cp``) is cut into ``2 * cp`` chunks and CP rank
``r`` holds chunks ``r`` and ``2 * cp - 1 - r`` of every document (Megatron's per-document split).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ThdLayout", "packed_cp_group", "thd_layout", "thd_layout_from_cu", "thd_partitioned_indices",
           "thd_positions", "thd_positions_from_cu"]

_CACHE_ATTR = "_mcore_thd_cache"


@dataclass(frozen=True)
class ThdLayout:
    """Per document: ``starts`` (offset in the packed sequence), real ``lengths`` and ``padded`` extents."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    padded: tuple[int, ...]
    total: int


def _host_list(name: str, cu: Any) -> list[int]:
    if not isinstance(cu, torch.Tensor):
        raise ValueError(f"PackedSeqParams.{name} must be an integer tensor, got {type(cu).__name__}")
    if cu.is_floating_point() or cu.is_complex():
        raise ValueError(f"PackedSeqParams.{name} must be an integer tensor, got dtype {cu.dtype}")
    if cu.dim() == 2 and cu.shape[0] == 1:
        cu = cu[0]
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"PackedSeqParams.{name} must be 1-D with at least 2 entries, got shape {tuple(cu.shape)}")
    values = [int(x) for x in cu.tolist()]
    if values[0] != 0:
        raise ValueError(f"PackedSeqParams.{name} must start at 0, got {values[:4]}...")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"PackedSeqParams.{name} must be non-decreasing (cumulative document lengths); "
                f"entry {i} is {values[i]} after {values[i - 1]}: {values}"
            )
    return values


def _build(params: Any, which: str, total_tokens: int) -> ThdLayout:
    real_name, pad_name = f"cu_seqlens_{which}", f"cu_seqlens_{which}_padded"
    real = _host_list(real_name, getattr(params, real_name))
    padded_cu = getattr(params, pad_name, None)
    if padded_cu is None:
        padded, name = real, real_name
    else:
        padded, name = _host_list(pad_name, padded_cu), pad_name
        if len(padded) != len(real):
            raise ValueError(
                f"PackedSeqParams.{pad_name} has {len(padded)} entries but {real_name} has {len(real)}; "
                "they must describe the same documents"
            )
    if padded[-1] != total_tokens:
        raise ValueError(
            f"PackedSeqParams.{name} must end at the packed token count ({total_tokens}), got {padded[-1]} "
            f"({name}={padded})"
        )
    lengths = tuple(b - a for a, b in zip(real[:-1], real[1:]))
    extents = tuple(b - a for a, b in zip(padded[:-1], padded[1:]))
    for i, (n, p) in enumerate(zip(lengths, extents)):
        if n > p:
            raise ValueError(f"document {i}: real length {n} ({real_name}) exceeds its padded length {p} ({pad_name})")
    return ThdLayout(tuple(padded[:-1]), lengths, extents, total_tokens)


def packed_cp_group(params: Any, cp_group: Any) -> Any:
    """The context-parallel group of one forward: ``params.cp_group`` when set (hybrid CP), ``None`` (no CP)
    when ``params.local_cp_size`` is 1 without a group, else the layer's ``cp_group``.

    Megatron-Core's rule (its Transformer Engine attention switches groups per call the same way). A
    ``local_cp_size`` other than 1 without a group, or one that disagrees with the group's size, is a ``ValueError``.
    """
    if params is None:
        return cp_group
    group, size = getattr(params, "cp_group", None), getattr(params, "local_cp_size", None)
    if group is None:
        if size is None:
            return cp_group
        if int(size) != 1:
            raise ValueError(f"PackedSeqParams.local_cp_size ({int(size)}) needs PackedSeqParams.cp_group (None); "
                             "only local_cp_size=1 (context parallelism off) works without a group")
        return None
    if size is not None and int(size) != group.size():
        raise ValueError(f"PackedSeqParams.local_cp_size ({int(size)}) must equal the size of "
                         f"PackedSeqParams.cp_group ({group.size()})")
    return group


def thd_layout(params: Any, total_tokens: int, which: str = "q") -> ThdLayout:
    """The validated layout of ``params`` for a packed sequence of ``total_tokens`` tokens (cached on ``params``)."""
    if getattr(params, "qkv_format", "thd") not in (None, "thd"):
        raise ValueError(f"PackedSeqParams.qkv_format ({params.qkv_format!r}) must be 'thd'")
    cache = params.__dict__.setdefault(_CACHE_ATTR, {})
    key = (which, total_tokens)
    layout = cache.get(key)
    if layout is None:
        layout = cache[key] = _build(params, which, total_tokens)
    return layout


def _check_cp(layout: ThdLayout, cp_size: int) -> None:
    for i, p in enumerate(layout.padded):
        if p % (2 * cp_size) != 0:
            raise ValueError(
                f"packed document {i} has padded length {p}, not divisible by 2 * context_parallel_size "
                f"({2 * cp_size}); pad documents with cu_seqlens_q_padded"
            )


def thd_partitioned_indices(layout: ThdLayout, cp_size: int, cp_rank: int) -> list[int]:
    """Global packed indices held by CP rank ``cp_rank``: chunks ``r`` and ``2cp-1-r`` of every document."""
    if cp_size == 1:
        return list(range(layout.total))
    _check_cp(layout, cp_size)
    out: list[int] = []
    for start, p in zip(layout.starts, layout.padded):
        c = p // (2 * cp_size)
        for chunk in (cp_rank, 2 * cp_size - 1 - cp_rank):
            out.extend(range(start + chunk * c, start + (chunk + 1) * c))
    return out


def thd_positions(layout: ThdLayout, cp_size: int = 1, cp_rank: int = 0, device: Any = None) -> torch.Tensor:
    """Position of every local token inside its document (RoPE restarts at 0 per document), cached."""
    key = (layout, cp_size, cp_rank, str(device))
    positions = _POSITIONS.get(key)
    if positions is None:
        doc_start = []
        for start, p in zip(layout.starts, layout.padded):
            doc_start.extend([start] * p)
        index = thd_partitioned_indices(layout, cp_size, cp_rank)
        positions = torch.tensor([i - doc_start[i] for i in index], dtype=torch.long, device=device)
        if len(_POSITIONS) > 64:
            _POSITIONS.clear()
        _POSITIONS[key] = positions
    return positions


_POSITIONS: dict[tuple, torch.Tensor] = {}


class _CuParams:
    """A stand-in params object so a bare ``cu_seqlens`` tensor can use :func:`thd_layout`."""

    qkv_format = "thd"

    def __init__(self, cu: torch.Tensor) -> None:
        self.cu_seqlens_q = cu
        self.cu_seqlens_q_padded = None


_CU_LAYOUTS: dict[tuple, tuple[Any, ThdLayout]] = {}


def thd_layout_from_cu(cu_seqlens: torch.Tensor, total_tokens: int) -> ThdLayout:
    """:func:`thd_layout` of a bare (padded) ``cu_seqlens`` tensor, cached per tensor."""
    key = (id(cu_seqlens), cu_seqlens._version, total_tokens)
    entry = _CU_LAYOUTS.get(key)
    if entry is None or entry[0]() is not cu_seqlens:
        if len(_CU_LAYOUTS) > 64:
            _CU_LAYOUTS.clear()
        entry = _CU_LAYOUTS[key] = (weakref.ref(cu_seqlens), thd_layout(_CuParams(cu_seqlens), total_tokens))
    return entry[1]


def thd_positions_from_cu(cu_seqlens: torch.Tensor, local_tokens: int, cp_size: int = 1, cp_rank: int = 0,
                          device: Any = None) -> torch.Tensor:
    """:func:`thd_positions` for a bare (padded) ``cu_seqlens`` tensor; the layout is cached per tensor."""
    return thd_positions(thd_layout_from_cu(cu_seqlens, local_tokens * cp_size), cp_size, cp_rank, device)
