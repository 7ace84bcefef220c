"""Normalising the CUDA-graph options of a config (Megatron-Core's ``transformer/cuda_graph_config.py``).

Pure helpers, used when training arguments or a config are validated; nothing here captures a graph.

* ``cuda_graph_modules`` may be given as ``None``, a comma-separated string, one
  :class:`~megatron_core.transformer.enums.CudaGraphModule`, or a list mixing names and members.
  :func:`normalize_cuda_graph_modules` turns it into members, sets aside the two deprecated names
  (``full_iteration`` and ``full_iteration_inference``, which now belong to other options) and
  recognises ``"full"`` (capture the whole layer).
* :func:`validate_deprecated_cuda_graph_modules_migration_inputs` refuses a deprecated name combined
  with new-style options that contradict it; :func:`get_deprecated_cuda_graph_modules_migration`
  says which option a deprecated name sets.
* :func:`normalize_inference_cuda_graph_scope` resolves ``inference_cuda_graph_scope``, defaulting
  from ``cuda_graph_impl``; :data:`ALLOWED_INFERENCE_SCOPES` lists the scopes each implementation allows.

Bad inputs raise :class:`CudaGraphConfigError`, a ``ValueError`` that is also an ``AssertionError``
(Megatron-Core asserts here), so both kinds of handler catch it.
"""

from __future__ import annotations

from typing import Union

from megatron_core.transformer.enums import CudaGraphModule, InferenceCudaGraphScope

__all__ = [
    "ALLOWED_INFERENCE_SCOPES",
    "CUDA_GRAPH_MODULES_DEPRECATIONS",
    "CudaGraphConfigError",
    "get_deprecated_cuda_graph_modules_migration",
    "normalize_cuda_graph_modules",
    "normalize_inference_cuda_graph_scope",
    "validate_deprecated_cuda_graph_modules_migration_inputs",
]

CudaGraphModulesInput = Union[str, CudaGraphModule, list[Union[str, CudaGraphModule]], None]
"""What ``cuda_graph_modules`` may be set to."""

DeprecatedScope = tuple[str, str, object]
"""``(deprecated name, option it now sets, value for that option)``."""


class CudaGraphConfigError(ValueError, AssertionError):
    """An invalid or contradictory CUDA-graph option (catchable as ``ValueError`` or ``AssertionError``)."""


CUDA_GRAPH_MODULES_DEPRECATIONS: dict[str, tuple[str, object]] = {
    "full_iteration": ("cuda_graph_impl", "full_iteration"),
    "full_iteration_inference": ("inference_cuda_graph_scope", InferenceCudaGraphScope.block),
}
"""Deprecated ``cuda_graph_modules`` names -> ``(option, value)`` that replaces each."""

ALLOWED_INFERENCE_SCOPES: dict[str, frozenset[InferenceCudaGraphScope]] = {
    "none": frozenset({InferenceCudaGraphScope.none}),
    "local": frozenset({InferenceCudaGraphScope.layer, InferenceCudaGraphScope.block}),
    "transformer_engine": frozenset({InferenceCudaGraphScope.none}),
    "full_iteration": frozenset({InferenceCudaGraphScope.none}),
}
"""For each ``cuda_graph_impl``, the ``inference_cuda_graph_scope`` values it can be combined with."""


def _member_by_name(enum_cls: type, name: str, option: str):
    """``enum_cls[name]``, or :class:`CudaGraphConfigError` listing the valid names."""
    try:
        return enum_cls[name]
    except KeyError:
        valid = ", ".join(repr(m.name) for m in enum_cls)
        raise CudaGraphConfigError(f"{option}: unknown value {name!r}; valid names are {valid}") from None


def _scope_label(scope: object) -> object:
    return scope.name if isinstance(scope, InferenceCudaGraphScope) else scope


def normalize_cuda_graph_modules(
    scopes: CudaGraphModulesInput,
) -> tuple[list[CudaGraphModule], list[DeprecatedScope], bool]:
    """Split a ``cuda_graph_modules`` value into ``(modules, deprecated, full)``.

    ``modules`` are the :class:`CudaGraphModule` members named, in order; ``deprecated`` holds a
    ``(name, option, value)`` triple for each deprecated name (see
    :data:`CUDA_GRAPH_MODULES_DEPRECATIONS`); ``full`` is ``True`` only for ``"full"``, which must
    then be the only entry (and both lists are empty). ``None`` and ``""`` give ``([], [], False)``.
    """
    if scopes is None:
        entries: list = []
    elif isinstance(scopes, list):
        entries = list(scopes)
    elif isinstance(scopes, str):
        entries = scopes.split(",") if scopes else []
    else:
        entries = [scopes]

    if "full" in entries:
        if entries != ["full"]:
            raise CudaGraphConfigError(
                f"cuda_graph_modules: 'full' captures the whole layer and cannot be combined with other "
                f"entries, got {entries!r}"
            )
        return [], [], True

    modules: list[CudaGraphModule] = []
    deprecated: list[DeprecatedScope] = []
    for entry in entries:
        if isinstance(entry, CudaGraphModule):
            modules.append(entry)
        elif isinstance(entry, str):
            if entry in CUDA_GRAPH_MODULES_DEPRECATIONS:
                option, value = CUDA_GRAPH_MODULES_DEPRECATIONS[entry]
                deprecated.append((entry, option, value))
            else:
                modules.append(_member_by_name(CudaGraphModule, entry, "cuda_graph_modules"))
        else:
            raise CudaGraphConfigError(
                f"cuda_graph_modules: entries must be names or CudaGraphModule members, got {entry!r} "
                f"({type(entry).__name__})"
            )
    return modules, deprecated, False


def normalize_inference_cuda_graph_scope(
    scope: str | InferenceCudaGraphScope | None, cuda_graph_impl: str
) -> InferenceCudaGraphScope:
    """``inference_cuda_graph_scope`` as a member; ``None`` means ``layer`` for the ``local`` impl, else ``none``."""
    if scope is None:
        return InferenceCudaGraphScope.layer if cuda_graph_impl == "local" else InferenceCudaGraphScope.none
    if isinstance(scope, InferenceCudaGraphScope):
        return scope
    if not isinstance(scope, str):
        raise CudaGraphConfigError(
            f"inference_cuda_graph_scope must be a name or an InferenceCudaGraphScope member, got {scope!r} "
            f"({type(scope).__name__})"
        )
    return _member_by_name(InferenceCudaGraphScope, scope, "inference_cuda_graph_scope")


# deprecated name -> (cuda_graph_impl values it may be combined with, inference scopes it may be combined with)
_MIGRATION_COMPATIBLE: dict[str, tuple[tuple[str, ...], tuple[InferenceCudaGraphScope | None, ...]]] = {
    "full_iteration": (("none", "local", "full_iteration"), (None, InferenceCudaGraphScope.none)),
    "full_iteration_inference": (("none", "local"), (None, InferenceCudaGraphScope.block)),
}


def validate_deprecated_cuda_graph_modules_migration_inputs(
    deprecated_scopes: list[DeprecatedScope],
    cuda_graph_impl: str,
    inference_cuda_graph_scope: str | InferenceCudaGraphScope | None,
) -> None:
    """Refuse deprecated ``cuda_graph_modules`` names that are ambiguous or contradict the new options.

    ``deprecated_scopes`` is the second item of :func:`normalize_cuda_graph_modules`. Rules: at most
    one distinct deprecated name; ``full_iteration`` needs ``cuda_graph_impl`` in ``none`` / ``local`` /
    ``full_iteration`` and no inference scope other than ``none``; ``full_iteration_inference`` needs
    ``cuda_graph_impl`` in ``none`` / ``local`` and no inference scope other than ``block``.
    """
    names = [name for name, _, _ in deprecated_scopes]
    if not names:
        return
    if len(set(names)) > 1:
        raise CudaGraphConfigError(
            f"cuda_graph_modules may hold only one deprecated value at a time, got {names!r}"
        )
    name = names[0]
    if isinstance(inference_cuda_graph_scope, str):
        inference_cuda_graph_scope = _member_by_name(
            InferenceCudaGraphScope, inference_cuda_graph_scope, "inference_cuda_graph_scope"
        )
    if name not in _MIGRATION_COMPATIBLE:
        return
    impls, inference_scopes = _MIGRATION_COMPATIBLE[name]
    if cuda_graph_impl not in impls:
        raise CudaGraphConfigError(
            f"cuda_graph_modules={name!r} cannot be combined with cuda_graph_impl={cuda_graph_impl!r} "
            f"(allowed: {', '.join(repr(i) for i in impls)})"
        )
    if inference_cuda_graph_scope not in inference_scopes:
        allowed = ", ".join(repr(_scope_label(s)) for s in inference_scopes)
        raise CudaGraphConfigError(
            f"cuda_graph_modules={name!r} cannot be combined with inference_cuda_graph_scope="
            f"{_scope_label(inference_cuda_graph_scope)!r} (allowed: {allowed})"
        )


def get_deprecated_cuda_graph_modules_migration(
    scope: str, attr: str, value: object, cuda_graph_impl: str
) -> tuple[str, object] | None:
    """The ``(option, value)`` a deprecated name should set, or ``None`` when it has no effect.

    ``full_iteration_inference`` does nothing when ``cuda_graph_impl`` is ``"none"`` (there are no
    graphs to scope); every other case returns ``(attr, value)`` unchanged.
    """
    if scope == "full_iteration_inference" and cuda_graph_impl == "none":
        return None
    return attr, value
