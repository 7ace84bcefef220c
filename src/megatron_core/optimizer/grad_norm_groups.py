"""Separately clipped gradient groups (Megatron-Core 0.19): parameters tagged ``grad_norm_group``.

A parameter with ``param.grad_norm_group = "mtp"`` (the multi-token-prediction block tags its parameters so when
``config.mtp_detach_heads`` is set) is left out of the optimizer's main gradient norm, the norm that ``step``
returns, checks for inf/nan and compares with ``grad_norm_skip_threshold``; with ``clip_grad > 0`` its gradients
are clipped by the norm of their own group instead. Only the names in :data:`SEPARATE_GRAD_NORM_GROUPS` may be
used; any other raises ``ValueError`` rather than silently joining the main norm.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.device import get_current_device
from megatron_core.distributed import collectives

__all__ = ["GRAD_NORM_GROUP_ATTR", "MTP_GRAD_NORM_GROUP", "SEPARATE_GRAD_NORM_GROUPS", "any_rank_has_grad_norm_group",
           "get_param_grad_norm_group", "in_grad_norm", "is_separate_grad_norm_group", "split_by_grad_norm_group",
           "validate_grad_norm_group"]

GRAD_NORM_GROUP_ATTR = "grad_norm_group"
"""The parameter attribute that names a separately-normed gradient group."""
MTP_GRAD_NORM_GROUP = "mtp"
SEPARATE_GRAD_NORM_GROUPS = (MTP_GRAD_NORM_GROUP,)
"""The groups the optimizer norms and clips apart from the main gradients."""


def get_param_grad_norm_group(param: torch.Tensor) -> str | None:
    """The separate gradient-norm group ``param`` is tagged with, if any."""
    return getattr(param, GRAD_NORM_GROUP_ATTR, None)


def validate_grad_norm_group(grad_norm_group: str) -> None:
    """Raise ``ValueError`` unless ``grad_norm_group`` is one of :data:`SEPARATE_GRAD_NORM_GROUPS`."""
    if grad_norm_group not in SEPARATE_GRAD_NORM_GROUPS:
        raise ValueError(f"Unknown grad_norm_group {grad_norm_group!r}: the registered groups are "
                         f"{SEPARATE_GRAD_NORM_GROUPS} (SEPARATE_GRAD_NORM_GROUPS); register a group there before "
                         "tagging parameters with it")


def is_separate_grad_norm_group(grad_norm_group: str | None) -> bool:
    """Whether the optimizer norms this group apart (``None``: the main norm); an unknown name raises."""
    if grad_norm_group is None:
        return False
    validate_grad_norm_group(grad_norm_group)
    return True


def in_grad_norm(param: torch.Tensor, grad_norm_group: str | None) -> bool:
    """Whether ``param``'s gradient belongs to the main norm (``grad_norm_group`` None) or to the named group."""
    if grad_norm_group is None:
        return not is_separate_grad_norm_group(get_param_grad_norm_group(param))
    validate_grad_norm_group(grad_norm_group)
    return get_param_grad_norm_group(param) == grad_norm_group


def split_by_grad_norm_group(params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], dict[str, list[torch.Tensor]]]:
    """``(the main params, {group: its params})``, each list in the given order."""
    main: list[torch.Tensor] = []
    grouped: dict[str, list[torch.Tensor]] = {}
    for param in params:
        group = get_param_grad_norm_group(param)
        if is_separate_grad_norm_group(group):
            grouped.setdefault(group, []).append(param)
        else:
            main.append(param)
    return main, grouped


def any_rank_has_grad_norm_group(params: Iterable[torch.Tensor], grad_norm_group: str, stats_group: Any) -> bool:
    """Whether a parameter of ``grad_norm_group`` is among ``params`` on any rank of ``stats_group`` (None: WORLD,
    as for the gradient norms; one max all-reduce: every rank must call it, so that the group's own norm is
    reduced by all or by none)."""
    validate_grad_norm_group(grad_norm_group)
    params = list(params)
    local = any(get_param_grad_norm_group(p) == grad_norm_group for p in params)
    # The params' device (the one their norms are reduced on), else this process's device (a rank owning none).
    device = params[0].device if params else get_current_device()
    flag = torch.tensor([1.0 if local else 0.0], device=device)
    if stats_group is None:
        stats_group = dist.group.WORLD if dist.is_initialized() else collectives.LOCAL
    collectives.all_reduce(flag, stats_group, op="max")
    return bool(flag.item() > 0)
