"""Find attributes of a model through its wrappers (Megatron-Core's ``get_attr_wrapped_model``).

Training code wraps each model chunk, e.g. ``DistributedDataParallel(Float16Module(GPTModel))``;
every wrapper keeps the wrapped module in ``.module``. The schedules use these helpers to reach
``set_input_tensor`` and ``config`` on the innermost module that has them.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import module_chain


def get_attr_wrapped_model(model: Any, attr: str, allow_none: bool = True, return_model_obj: bool = False) -> Any:
    """``attr`` of the outermost module in the ``.module`` chain of ``model`` that has it.

    With ``allow_none=False`` a module whose ``attr`` is ``None`` is skipped. With
    ``return_model_obj=True`` the module itself is returned instead of the attribute.
    """
    if isinstance(model, list):
        raise RuntimeError(f"get_attr_wrapped_model needs one model chunk, got a list of {len(model)}")
    found = next((m for m in module_chain(model)
                  if (hasattr(m, attr) if allow_none else getattr(m, attr, None) is not None)), None)
    if found is None:
        raise RuntimeError(
            f"get_attr_wrapped_model: no attribute '{attr}' on {type(model).__name__} or the modules it wraps"
        )
    return found if return_model_obj else getattr(found, attr)


def get_model_config(model: Any) -> Any:
    """The ``config`` (a ``ModelParallelConfig`` or ``TransformerConfig``) of a possibly wrapped model."""
    return get_attr_wrapped_model(model, "config", allow_none=False)


def submodules_with_attribute(root: Any, *names: str) -> list[Any]:
    """``root``'s submodules (itself included) that have any of the attributes ``names``.

    Found by one walk over every module on the first call and remembered on ``root``: a walk costs about a
    millisecond of host time, and the callers ask once per training step.
    """
    cache = root.__dict__.setdefault("_submodules_with_attribute", {})
    if names not in cache:
        cache[names] = [m for m in root.modules() if any(hasattr(m, name) for name in names)]
    return cache[names]


def innermost_module(model: Any) -> Any:
    """The module at the end of ``model``'s ``.module`` chain (every wrapper stripped, whatever its class)."""
    return next(m for m in module_chain(model) if not isinstance(getattr(m, "module", None), torch.nn.Module))
