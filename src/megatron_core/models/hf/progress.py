"""Progress reporting for conversions: a ``tqdm`` bar when tqdm is installed, plain lines otherwise."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, desc: str, enabled: bool = True) -> Iterator[T]:
    """Yield ``items``, reporting progress on stderr (a tqdm bar, or a line every 10%)."""
    if not enabled:
        yield from items
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        yield from tqdm(items, total=total, desc=desc, unit="tensor", file=sys.stderr)
        return
    step = max(1, total // 10)
    for count, item in enumerate(items, start=1):
        yield item
        if count % step == 0 or count == total:
            print(f"{desc}: {count}/{total} tensors", file=sys.stderr, flush=True)
