"""Range and plan helpers shared by the KV and Mamba reshard planners (Megatron-Core 0.19's
``inference.disaggregation.utils``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

__all__ = ["intersect", "transfers_for_dst", "transfers_for_src"]

Transfer = TypeVar("Transfer")


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The overlap of half-open ranges ``[a0, a1)`` and ``[b0, b1)``, or ``None`` when they share nothing."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def transfers_for_src(plan: Iterable[Transfer], src_rank: int) -> list[Transfer]:
    """The transfers of ``plan`` (KV or Mamba) that ``src_rank`` sends, in plan order."""
    return [t for t in plan if t.src_rank == src_rank]


def transfers_for_dst(plan: Iterable[Transfer], dst_rank: int) -> list[Transfer]:
    """The transfers of ``plan`` (KV or Mamba) that ``dst_rank`` receives, in plan order."""
    return [t for t in plan if t.dst_rank == dst_rank]

