"""Small helpers shared across subpackages: divisibility checks, init methods, API lifecycle.

``deprecated`` and ``experimental_api`` implement the policy in ``docs/api_policy.md``.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])


def ensure_divisibility(numerator: int, denominator: int, what: str = "") -> None:
    """Raise ``ValueError`` unless ``numerator`` is divisible by ``denominator``."""
    if denominator <= 0 or numerator % denominator != 0:
        label = f"{what}: " if what else ""
        raise ValueError(f"{label}{numerator} is not divisible by {denominator}")


def divide(numerator: int, denominator: int, what: str = "") -> int:
    """Integer division that raises ``ValueError`` when it is not exact."""
    ensure_divisibility(numerator, denominator, what)
    return numerator // denominator


def get_pg_size(group: Any = None) -> int:
    """Number of ranks in ``group``: 1 when ``group`` is None or ``torch.distributed`` is not initialised.

    As in Megatron-Core, ``None`` here means "no group" (no parallelism), never the WORLD group.
    """
    if group is None or not torch.distributed.is_initialized():
        return 1
    return group.size()


def get_pg_rank(group: Any = None) -> int:
    """This rank's index in ``group``: 0 when ``group`` is None or ``torch.distributed`` is not initialised."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return group.rank()


def get_pg_src_rank(group: Any = None) -> int:
    """Global rank of ``group``'s first member: 0 when ``group`` is None or nothing is initialised."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_process_group_ranks(group)[0]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """An init method that fills a tensor from N(0, sigma^2)."""

    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)

    return init_


def scaled_init_method_normal(
    sigma: float, num_layers: int, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(multiplier * num_layers))^2), Megatron's init for output projections."""
    return init_method_normal(sigma / math.sqrt(multiplier * num_layers))


class ExperimentalNotEnabledError(RuntimeError):
    """Raised when an experimental API is used without ``megatron_core.config.ENABLE_EXPERIMENTAL``."""


def deprecated(
    version: str, removal_version: str, alternative: str | None = None, reason: str | None = None
) -> Callable[[F], F]:
    """Mark a function or class deprecated: it warns on use and is removed in ``removal_version``."""

    def decorate(obj: F) -> F:
        message = f"{obj.__qualname__} is deprecated since {version} and will be removed in {removal_version}."
        if alternative:
            message += f" Use {alternative} instead."
        if reason:
            message += f" {reason}"

        if isinstance(obj, type):
            original_init = obj.__init__

            @functools.wraps(original_init)
            def init(self, *args, **kwargs):
                warnings.warn(message, DeprecationWarning, stacklevel=2)
                original_init(self, *args, **kwargs)

            obj.__init__ = init
            obj._deprecated = True
            return obj

        @functools.wraps(obj)
        def wrapper(*args, **kwargs):
            warnings.warn(message, DeprecationWarning, stacklevel=2)
            return obj(*args, **kwargs)

        wrapper._deprecated = True
        return wrapper  # type: ignore[return-value]

    return decorate


def experimental_api(obj: F) -> F:
    """Mark an API experimental: it raises unless ``config.ENABLE_EXPERIMENTAL`` is True."""
    from megatron_core import config

    if isinstance(obj, type):
        original_init = obj.__init__

        @functools.wraps(original_init)
        def init(self, *args, **kwargs):
            if not config.ENABLE_EXPERIMENTAL:
                raise ExperimentalNotEnabledError(
                    f"{obj.__qualname__} is experimental; set megatron_core.config.ENABLE_EXPERIMENTAL = True"
                )
            original_init(self, *args, **kwargs)

        obj.__init__ = init
        obj._experimental = True
        return obj

    @functools.wraps(obj)
    def wrapper(*args, **kwargs):
        if not config.ENABLE_EXPERIMENTAL:
            raise ExperimentalNotEnabledError(
                f"{obj.__qualname__} is experimental; set megatron_core.config.ENABLE_EXPERIMENTAL = True"
            )
        return obj(*args, **kwargs)

    wrapper._experimental = True
    return wrapper  # type: ignore[return-value]


# Megatron-Core's ``megatron.core.utils`` names, implemented in small modules of their own.
# ruff: noqa: E402
from megatron_core._batch_utils import get_batch_on_this_tp_rank as get_batch_on_this_tp_rank
from megatron_core._model_utils import (
    check_param_hashes_across_dp_replicas as check_param_hashes_across_dp_replicas,
)
from megatron_core._model_utils import (
    get_data_parallel_group_if_dtensor as get_data_parallel_group_if_dtensor,
)
from megatron_core._model_utils import local_multi_tensor_applier as local_multi_tensor_applier
from megatron_core._model_utils import local_multi_tensor_l2_norm as local_multi_tensor_l2_norm
from megatron_core._model_utils import local_multi_tensor_scale as local_multi_tensor_scale
from megatron_core._model_utils import to_local_if_dtensor as to_local_if_dtensor
from megatron_core._model_utils import unwrap_model as unwrap_model
from megatron_core._nvtx import configure_nvtx_profiling as configure_nvtx_profiling
from megatron_core._nvtx import nvtx_decorator as nvtx_decorator
from megatron_core._nvtx import nvtx_range_pop as nvtx_range_pop
from megatron_core._nvtx import nvtx_range_push as nvtx_range_push
from megatron_core._rank_utils import log_single_rank as log_single_rank
from megatron_core._straggler import StragglerDetector as StragglerDetector
from megatron_core._version_utils import get_fa_version as get_fa_version
from megatron_core._version_utils import get_flashinfer_version as get_flashinfer_version
from megatron_core._version_utils import get_te_version as get_te_version
from megatron_core._version_utils import get_torch_version as get_torch_version
from megatron_core._version_utils import is_fa_min_version as is_fa_min_version
from megatron_core._version_utils import is_flashinfer_min_version as is_flashinfer_min_version
from megatron_core._version_utils import is_te_min_version as is_te_min_version
from megatron_core._version_utils import is_torch_min_version as is_torch_min_version
from megatron_core._wrapped_model import get_attr_wrapped_model as get_attr_wrapped_model
from megatron_core._wrapped_model import get_model_config as get_model_config
