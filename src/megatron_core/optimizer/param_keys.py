"""Which parameters a per-group optimizer override applies to: ``ParamKey`` and its hashable predicates.

``get_megatron_optimizer(config, model_chunks, config_overrides={ParamKey(...): ParamGroupOverride(...)})`` gives
the parameters a key matches the override's values (``max_lr``, ``min_lr``, ``wd_mult``, ...). A key matches a
parameter when any of its parts does: a name pattern (``fnmatch`` syntax, e.g. ``"*.bias"``), a true attribute
of the parameter (e.g. ``"is_embedding_or_output_parameter"``), a predicate on the parameter, or a predicate on
the parameter and its name. Predicates are compared and hashed by their ``name`` only, so that equal keys built
twice (on every rank, in every call) group the same parameters.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

__all__ = ["ParamKey", "ParamPredicate", "ParamWithNamePredicate"]


@dataclass(frozen=True)
class ParamPredicate:
    """A named test of a parameter (``fn(param) -> bool``); equal and hashed by ``name``."""

    name: str
    fn: Callable[[torch.nn.Parameter], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter) -> bool:
        return bool(self.fn(param))


@dataclass(frozen=True)
class ParamWithNamePredicate:
    """A named test of a parameter and its module-relative name (``fn(param, name) -> bool``)."""

    name: str
    fn: Callable[[torch.nn.Parameter, str], bool] = field(compare=False, hash=False)

    def __call__(self, param: torch.nn.Parameter, name: str) -> bool:
        return bool(self.fn(param, name))


_T = TypeVar("_T")


def _as_tuple(value: _T | Iterable[_T], single: type | tuple[type, ...]) -> tuple[_T, ...]:
    return (value,) if isinstance(value, single) else tuple(value)


@dataclass(frozen=True)
class ParamKey:
    """Parameters by name pattern(s), attribute(s) and predicate(s); a parameter matches if any part does."""

    name: str | tuple[str, ...] = field(default_factory=tuple)
    attr: str | tuple[str, ...] = field(default_factory=tuple)
    predicate: ParamPredicate | tuple[ParamPredicate, ...] = field(default_factory=tuple)
    with_name_predicate: ParamWithNamePredicate | tuple[ParamWithNamePredicate, ...] = field(default_factory=tuple)

    def matches(self, param: torch.nn.Parameter, param_name: str) -> bool:
        """Whether ``param`` (called ``param_name`` in its model chunk) is selected by this key."""
        if any(fnmatch.fnmatch(param_name, pattern) for pattern in _as_tuple(self.name, str)):
            return True
        if any(getattr(param, attr, False) for attr in _as_tuple(self.attr, str)):
            return True
        if any(test(param) for test in _as_tuple(self.predicate, ParamPredicate)):
            return True
        return any(test(param, param_name) for test in _as_tuple(self.with_name_predicate, ParamWithNamePredicate))
