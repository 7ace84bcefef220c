"""Fewer Dynamo guards for compiled transformer layers, keeping every guard whose value decides what a layer computes.

Each call of a ``torch.compile``-d layer first checks the guards Dynamo installed when it traced the layer: several
hundred for a Megatron layer (the module tree's types, hooks dictionaries and attributes, the config fields the
forward reads, the parameters' metadata). Where a training step is bound by the host (an FP8 MoE step whose experts
read their group sizes on the host) that check is on the critical path.

:func:`module_value_guard_filter` is a ``guard_filter_fn`` for ``torch.compile``: it drops the guards on the
structure of the compiled modules (their types, identities, hooks dictionaries, attribute presence, closures and,
unless asked to keep them, the parameters' metadata) and keeps every guard on a value: the Python scalars a forward
branches on (``training``, ``is_first_microbatch``, the config's fields), the inputs, the globals and the global
state. A module whose *structure* changes after its first compile (a hook registered, a submodule or parameter
replaced by one of another shape) must be compiled again (``torch._dynamo.reset()``); a changed flag or config value
still recompiles, as without the filter. :func:`layer_compile_options` returns ``torch.compile``'s ``options`` with it
where the installed torch takes a guard filter, and nothing elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["VALUE_GUARD_TYPES", "layer_compile_options", "module_value_and_tensor_guard_filter", "module_value_guard_filter"]

# Guards on a value, kept wherever they are: a forward's branches and its constants depend on them.
VALUE_GUARD_TYPES = frozenset({"CONSTANT_MATCH", "EQUALS_MATCH"})


def _on_module(entry: Any) -> bool:
    """Whether a guard's source lies inside a compiled (unspecialized) ``nn.Module``."""
    return entry.orig_guard.source.is_unspecialized_nn_module()


def module_value_guard_filter(entries: Sequence[Any], keep_parameter_guards: bool = False) -> list[bool]:
    """``torch.compile``'s ``guard_filter_fn``: keep each guard but the structural ones on compiled modules (module
    docstring); with ``keep_parameter_guards`` the parameters' tensor guards stay too."""
    keep = []
    for entry in entries:
        kept = (not _on_module(entry) or entry.guard_type in VALUE_GUARD_TYPES
                or (keep_parameter_guards and entry.guard_type == "TENSOR_MATCH"))
        keep.append(kept)
    return keep


def module_value_and_tensor_guard_filter(entries: Sequence[Any]) -> list[bool]:
    """:func:`module_value_guard_filter` that keeps the parameters' tensor guards too."""
    return module_value_guard_filter(entries, keep_parameter_guards=True)


def layer_compile_options() -> dict[str, Any]:
    """``torch.compile(..., options=...)`` for a transformer layer: :func:`module_value_guard_filter` where this
    torch takes a ``guard_filter_fn`` (it ships ``torch.compiler.skip_guard_on_all_nn_modules_unsafe`` beside it),
    else empty."""
    if not hasattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe"):
        return {}
    return {"guard_filter_fn": module_value_guard_filter}
