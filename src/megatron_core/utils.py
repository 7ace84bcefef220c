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


def get_tensor_model_parallel_group_if_none(
    tp_group: Any = None, is_expert: bool = False, check_initialized: bool = True
) -> Any:
    """Megatron-Core's helper: ``tp_group``, else the (expert) TP group of ``parallel_state``.

    ``None`` before ``torch.distributed`` is initialised. Otherwise the lookup is
    :func:`megatron_core.process_groups_config.resolve_process_group`; when it finds no group,
    ``check_initialized=True`` raises ``parallel_state``'s "not initialized" error, as Megatron-Core
    does, and ``check_initialized=False`` returns ``None`` (no TP, size 1).
    """
    if not torch.distributed.is_initialized():
        return None
    from megatron_core.process_groups_config import resolve_process_group  # lazy-import: it imports utils

    group = resolve_process_group("expt_tp" if is_expert else "tp", group=tp_group)
    if group is None and check_initialized:
        from megatron_core import parallel_state

        getter = (parallel_state.get_expert_tensor_parallel_group if is_expert
                  else parallel_state.get_tensor_model_parallel_group)
        getter(check_initialized=True)
    return group


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


def mup_scaled_init_method_normal(
    sigma: float, num_layers: int, width_mult: float, multiplier: float = 2.0
) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / (sqrt(multiplier * num_layers) * sqrt(width_mult)))^2): muP's output-projection init."""
    return init_method_normal(sigma / (math.sqrt(multiplier * num_layers) * math.sqrt(width_mult)))


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
from megatron_core._misc_utils import GlobalMemoryBuffer as GlobalMemoryBuffer
from megatron_core._misc_utils import MakeViewlessTensor as MakeViewlessTensor
from megatron_core._misc_utils import WrappedTensor as WrappedTensor
from megatron_core._misc_utils import accepts_parameter as accepts_parameter
from megatron_core._misc_utils import assert_viewless_tensor as assert_viewless_tensor
from megatron_core._misc_utils import get_model_type as get_model_type
from megatron_core._misc_utils import get_model_xattn as get_model_xattn
from megatron_core._misc_utils import is_submodule as is_submodule
from megatron_core._misc_utils import log_on_each_pipeline_stage as log_on_each_pipeline_stage
from megatron_core._misc_utils import make_sharded_tensor_for_checkpoint as make_sharded_tensor_for_checkpoint
from megatron_core._misc_utils import (
    make_tp_sharded_tensor_for_checkpoint as make_tp_sharded_tensor_for_checkpoint,
)
from megatron_core._misc_utils import make_viewless_tensor as make_viewless_tensor
from megatron_core._misc_utils import round_up_to_nearest_multiple as round_up_to_nearest_multiple
from megatron_core._misc_utils import safely_set_viewless_tensor_data as safely_set_viewless_tensor_data
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
from megatron_core._packed_batch import (
    flatten_batch_for_packed_sequences as flatten_batch_for_packed_sequences,
)
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

# --- context parallelism -----------------------------------------------------------------------

_CP_METADATA_KEYS = ("cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size", "hybrid_cp_group")


def _split_sequence_zigzag(key: str, val: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    seq_dim = 2 if key == "attention_mask" else 1
    length = val.shape[seq_dim]
    if length % (2 * cp_size) != 0:
        raise ValueError(
            f"get_batch_on_this_cp_rank: batch[{key!r}] has sequence length {length} (dim {seq_dim}), not "
            f"divisible by 2 * context_parallel_size ({2 * cp_size})"
        )
    val = val.view(*val.shape[:seq_dim], 2 * cp_size, length // (2 * cp_size), *val.shape[seq_dim + 1:])
    index = torch.tensor([cp_rank, 2 * cp_size - 1 - cp_rank], device=val.device)
    val = val.index_select(seq_dim, index)
    return val.view(*val.shape[:seq_dim], -1, *val.shape[seq_dim + 2:])


def get_batch_on_this_cp_rank(
    batch: dict[str, Any], is_hybrid_cp: bool = False, cp_group: Any = None,
    hybrid_cp_group_func: Callable | None = None, use_per_sequence_balancing: bool = False,
) -> dict[str, Any]:
    """This context-parallel rank's part of ``batch`` (Megatron's load-balanced split).

    Without ``cu_seqlens`` (or with ``use_per_sequence_balancing``) every tensor's sequence
    dimension (dim 1; dim 2 for ``attention_mask``) is cut into ``2 * cp`` chunks and CP rank ``r``
    keeps chunks ``r`` and ``2 * cp - 1 - r``. With ``cu_seqlens`` (packed documents) the same split
    is applied to every document (``cu_seqlens_padded`` if present) of ``tokens``, ``labels``,
    ``loss_mask`` and ``position_ids``. Metadata keys and ``None`` values are left as they are.
    The group is ``cp_group``, else ``parallel_state``'s CP group; hybrid CP is not supported.
    """
    if is_hybrid_cp:
        raise ValueError("get_batch_on_this_cp_rank: hybrid context parallelism (is_hybrid_cp=True) is not supported")
    from megatron_core.process_groups_config import resolve_process_group  # lazy-import: it imports utils

    group = resolve_process_group("cp", group=cp_group)
    cp_size = get_pg_size(group)
    if cp_size == 1:
        return batch
    cp_rank = get_pg_rank(group)
    if use_per_sequence_balancing or batch.get("cu_seqlens") is None:
        for key, val in list(batch.items()):
            if key in _CP_METADATA_KEYS or val is None:
                continue
            batch[key] = _split_sequence_zigzag(key, val, cp_size, cp_rank)
        return batch
    from megatron_core.transformer.packed_sequences import (  # lazy-import: utils is below transformer
        thd_layout,
        thd_partitioned_indices,
    )

    cu = batch.get("cu_seqlens_padded")
    cu = batch["cu_seqlens"] if cu is None else cu
    reference = batch.get("tokens") if batch.get("tokens") is not None else batch.get("labels")
    if reference is None:
        raise ValueError("get_batch_on_this_cp_rank: a packed batch needs 'tokens' or 'labels' to size the sequence")

    class _Cu:
        qkv_format = "thd"
        cu_seqlens_q = cu
        cu_seqlens_q_padded = None

    layout = thd_layout(_Cu(), reference.size(1))
    index = torch.tensor(thd_partitioned_indices(layout, cp_size, cp_rank), device=reference.device)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        if batch.get(key) is not None:
            batch[key] = batch[key].index_select(1, index)
    return batch
