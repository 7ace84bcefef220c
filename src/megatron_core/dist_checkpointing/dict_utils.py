"""Walking, filtering and merging nested dict/list state dicts (Megatron-Core ``dict_utils``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


def dict_list_map_inplace(f: Callable[[Any], Any], x: Any) -> Any:
    """Apply ``f`` to every leaf of nested dicts/lists, replacing leaves in place; returns ``x``."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Any) -> Any:
    """A new nested structure with ``f`` applied to every leaf."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def nested_values(x: Any) -> Iterator[Any]:
    """Every leaf of nested dicts/lists, depth first."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def _leaves(x: dict | list, prefix: tuple = ()) -> Iterator[tuple[dict | list, tuple, Any]]:
    """``(container, path, leaf)`` for every leaf of nested dicts/lists; ``path[-1]`` is its key in ``container``."""
    for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
        if isinstance(v, (dict, list)):
            yield from _leaves(v, prefix + (k,))
        else:
            yield x, prefix + (k,), v


def nested_items_iter(x: dict | list) -> Iterator[tuple[dict | list, Any, Any]]:
    """``(container, key, leaf)`` for every leaf of nested dicts/lists: ``container[key]`` is the leaf."""
    return ((container, path[-1], v) for container, path, v in _leaves(x))


def nested_path_items(x: dict | list, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """``(path, leaf)`` pairs of nested dicts/lists; ``path`` is the tuple of keys/indices (an extension)."""
    return ((path, v) for _, path, v in _leaves(x, prefix))


def dict_map(f: Callable[[Any], Any], d: dict | list) -> None:
    """Replace every leaf ``v`` of nested dicts/lists by ``f(v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: dict | list) -> None:
    """Replace every leaf ``v`` (under key or index ``k`` of its container) by ``f(k, v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(k, v)


def map_reduce(xs: Iterable[Any], key_fn: Callable[[Any], Any] = lambda x: x,
               value_fn: Callable[[Any], Any] = lambda x: x,
               reduce_fn: Callable[[list], Any] = lambda x: x) -> dict:
    """``{key_fn(x): reduce_fn([value_fn(x) for the xs of that key])}``, keys in first-seen order (the interface
    of ``more_itertools.map_reduce``)."""
    grouped: dict[Any, list] = {}
    for x in xs:
        grouped.setdefault(key_fn(x), []).append(value_fn(x))
    return {k: reduce_fn(values) for k, values in grouped.items()}


def inspect_types(x: Any, prefix: tuple = (), indent: int = 4) -> None:
    """Print the nested structure of ``x``: keys and indices, tensors' shapes, other leaves' types and values
    (truncated to 30 characters); a debugging aid."""
    pad = " " * indent * len(prefix)
    if isinstance(x, (dict, list)):
        print()
        for k, v in (x.items() if isinstance(x, dict) else enumerate(x)):
            print(f"{pad}{'>' if isinstance(x, dict) else '-'} {k}: ", end="")
            inspect_types(v, prefix + (k,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"Tensor of shape {x.shape}")
    else:
        try:
            text = str(x)
        except Exception:  # noqa: BLE001 - any object: its repr may fail
            text = "<no string repr>"
        print(f"[{type(x)}]: {text[:30] + '... (truncated)' if len(text) > 30 else text}")


def extract_matching_values(
    x: Any, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[Any, Any]:
    """Split nested dicts/lists into (leaves matching ``predicate``, the rest), keeping the nesting.

    Empty containers are dropped from the matching side. Lists keep their order but not their
    indices unless ``return_lists_as_dicts`` (then they become ``{index: value}`` dicts).
    """

    def split_items(items: Iterator[tuple[Any, Any]], as_dict: bool) -> tuple[Any, Any]:
        matching: Any = {} if as_dict else []
        other: Any = {} if as_dict else []

        def put(target: Any, k: Any, v: Any) -> None:
            if as_dict:
                target[k] = v
            else:
                target.append(v)

        for k, v in items:
            if isinstance(v, (dict, list)) and v:
                m, o = extract_matching_values(v, predicate, return_lists_as_dicts)
                if m:
                    put(matching, k, m)
                if o or not m:
                    put(other, k, o)
            elif predicate(v):
                put(matching, k, v)
            else:
                put(other, k, v)
        return matching, other

    if isinstance(x, dict):
        return split_items(iter(x.items()), True)
    if isinstance(x, list):
        return split_items(enumerate(x), return_lists_as_dicts)
    raise TypeError(f"expected a dict or list, got {type(x).__name__}")


def without_matching(x: Any, predicate: Callable[[Any], bool]) -> Any:
    """``x`` without the leaves matching ``predicate``, keeping list positions.

    Dicts drop matching entries (and containers emptied by the removal); lists that keep some
    value keep their length with ``None`` in place of matching leaves, so values merged back later
    land where they were. A list all of whose entries were removed is removed too (an empty list),
    so no placeholder of a value that is not there is left behind.
    """
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                stripped = without_matching(v, predicate)
                if stripped or not v:
                    out[k] = stripped
            elif not predicate(v):
                out[k] = v
        return out
    if isinstance(x, list):
        kept, out_list = False, []
        for v in x:
            if isinstance(v, (dict, list)):
                stripped = without_matching(v, predicate)
                kept = kept or bool(stripped) or not v
                out_list.append(stripped)
            elif predicate(v):
                out_list.append(None)
            else:
                kept = True
                out_list.append(v)
        return out_list if kept else []
    return x


def lists_like(x: Any, template: Any) -> Any:
    """``x`` with every ``{0: a, 1: b, ...}`` dict turned back into a list where ``template`` has a
    list of that length (undoing ``extract_matching_values(..., return_lists_as_dicts=True)``)."""
    if isinstance(x, dict) and isinstance(template, list):
        if sorted(x) == list(range(len(template))):
            return [lists_like(x[i], template[i]) for i in range(len(template))]
        return {k: lists_like(v, template[k]) if isinstance(k, int) and 0 <= k < len(template) else v
                for k, v in x.items()}
    if isinstance(x, dict) and isinstance(template, dict):
        return {k: lists_like(v, template[k]) if k in template else v for k, v in x.items()}
    if isinstance(x, list) and isinstance(template, list) and len(x) == len(template):
        return [lists_like(a, b) for a, b in zip(x, template)]
    return x


def merge(x1: Any, x2: Any, key: tuple = ()) -> Any:
    """Merge ``x2`` into ``x1`` (in place for dicts); values of ``x2`` win at the leaves.

    A dict with int keys merges into a list position by position (what
    ``extract_matching_values(..., return_lists_as_dicts=True)`` produces).
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            x1[k] = merge(x1[k], v2, key + (k,)) if k in x1 else v2
        return x1
    if isinstance(x1, list) and isinstance(x2, dict) and all(isinstance(k, int) for k in x2):
        for k, v2 in x2.items():
            if not 0 <= k < len(x1):
                raise ValueError(f"cannot merge position {k} into a list of length {len(x1)} at {key!r}")
            x1[k] = merge(x1[k], v2, key + (k,))
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            path = ".".join(map(str, key))
            raise ValueError(f"cannot merge lists of lengths {len(x1)} and {len(x2)} at {path!r}")
        return [merge(a, b, key + (i,)) for i, (a, b) in enumerate(zip(x1, x2))]
    return x2


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """``(only_left, only_right, mismatch)`` key paths between two nested structures."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        mismatch: list = []
        for k in x1.keys() & x2.keys():
            left, right, mis = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += mis
        return only_left, only_right, mismatch
    if isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        mismatch = []
        for i, (a, b) in enumerate(zip(x1, x2)):
            left, right, mis = diff(a, b, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += mis
        return only_left, only_right, mismatch
    if isinstance(x1, torch.Tensor) or isinstance(x2, torch.Tensor):
        same = (
            isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor)
            and x1.shape == x2.shape and x1.dtype == x2.dtype and torch.equal(x1.cpu(), x2.cpu())
        )
    else:
        try:
            same = bool(x1 == x2)
        except (RuntimeError, ValueError, TypeError):
            same = False
    return [], [], ([] if same else [(prefix, type(x1), type(x2))])
