"""Progress reporting for conversions (``megatron_core.progress``: a tqdm bar on a terminal, else lines)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from megatron_core.progress import track

T = TypeVar("T")


def progress(items: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """Yield ``items``, reporting progress on stderr (a tqdm bar on a terminal, else a line every 10%)."""
    return track(items, total, desc, unit="tensors", enabled=enabled)
