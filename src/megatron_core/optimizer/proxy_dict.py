"""``ProxyDict``: one dict-like view over several dicts, keyed ``(index, inner_key)`` (Megatron-Core 0.19).

``ChainedOptimizer.state`` returns one over its sub-optimizers' ``state`` dicts, so reads and writes go to the
sub-optimizer that owns the entry (a merged copy would drop writes).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class ProxyDict:
    """A view over ``inner_dicts``: key ``(i, k)`` is ``inner_dicts[i][k]``; reading a missing key gives ``None``."""

    def __init__(self, inner_dicts: list[dict]) -> None:
        self._inner_dicts = inner_dicts

    def __getitem__(self, key: tuple[int, Any]) -> Any:
        index, inner_key = key
        return self._inner_dicts[index].get(inner_key)

    def __setitem__(self, key: tuple[int, Any], value: Any) -> None:
        index, inner_key = key
        self._inner_dicts[index][inner_key] = value

    def __len__(self) -> int:
        return sum(len(inner) for inner in self._inner_dicts)

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        for index, inner in enumerate(self._inner_dicts):
            for inner_key in inner:
                yield index, inner_key

    def __contains__(self, key: object) -> bool:
        if not (isinstance(key, tuple) and len(key) == 2):
            return False
        index, inner_key = key
        return isinstance(index, int) and 0 <= index < len(self._inner_dicts) and inner_key in self._inner_dicts[index]

    def items(self) -> Iterator[tuple[tuple[int, Any], Any]]:
        """``((index, inner_key), value)`` for every entry of every inner dict."""
        for index, inner in enumerate(self._inner_dicts):
            for inner_key, value in inner.items():
                yield (index, inner_key), value


__all__ = ["ProxyDict"]
