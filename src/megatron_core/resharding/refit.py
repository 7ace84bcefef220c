"""Refit: copy a (training) model's weights into a model with another parallel layout, e.g. for inference.

:func:`swap_model_weights` picks a transport by name (``"gloo"``, ``"nccl"``; ``"nvshmem"`` and ``"nixl"``
raise ``ImportError`` here) or takes a :class:`CopyService`, builds the reshard plan once per layout pair
(a collective, cached) and runs it. Both models need a ``pg_collection``; on disjoint rank sets pass
``None`` for the model a rank does not hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core._ground import get_pg_size, unwrap_model
from megatron_core.resharding.copy_services.base import CopyService
from megatron_core.resharding.copy_services.gloo_copy_service import GlooCopyService
from megatron_core.resharding.copy_services.nccl_copy_service import NCCLCopyService
from megatron_core.resharding.copy_services.nixl_copy_service import NixlCopyService
from megatron_core.resharding.copy_services.nvshmem_copy_service import NVSHMEMCopyService
from megatron_core.resharding.execution import execute_reshard_plan
from megatron_core.resharding.planner import build_local_reshard_plan
from megatron_core.resharding.transforms import ReshardTransform
from megatron_core.resharding.utils import (
    ReshardPlan,
    invalidate_refit_tensor_cache,
    named_persistent_buffers,
)

__all__ = [
    "RefitBackendName",
    "clear_all_caches",
    "clear_plan_cache",
    "clear_service_cache",
    "get_or_create_service",
    "prepare_swap_model_weights",
    "reshard_model_weights",
    "swap_model_weights",
]

RefitBackendName = Literal["nccl", "gloo", "nvshmem", "nixl"]
_BACKENDS = {"nccl": NCCLCopyService, "gloo": GlooCopyService, "nvshmem": NVSHMEMCopyService,
             "nixl": NixlCopyService}


@dataclass(frozen=True)
class _PlanCacheKey:
    rank: int
    src_config: tuple[int, ...] | None
    dst_config: tuple[int, ...] | None
    num_experts: int | None
    world_size: int = 0
    src_rank_offset: int = 0
    dst_rank_offset: int = 0
    pool_index: int = 0


_service_cache: dict[str, CopyService] = {}
_plan_cache: dict[_PlanCacheKey, ReshardPlan] = {}


def _config_tuple(core: Any) -> tuple[int, ...] | None:
    """``(TP, PP, EP, DP, expert TP)`` sizes of a model's groups."""
    if core is None:
        return None
    pg = core.pg_collection
    return tuple(get_pg_size(getattr(pg, role, None)) for role in ("tp", "pp", "ep", "dp", "expt_tp"))


def get_or_create_service(backend: RefitBackendName, group: Any = None) -> CopyService:
    """The cached :class:`CopyService` for ``backend``, created on first use (``ValueError`` if unknown)."""
    if backend not in _service_cache:
        if backend not in _BACKENDS:
            raise ValueError(f"unknown refit backend {backend!r}; known: {sorted(_BACKENDS)}")
        _service_cache[backend] = _BACKENDS[backend](group=group)
    return _service_cache[backend]


def clear_service_cache() -> None:
    """Close and forget the cached copy services (before destroying process groups)."""
    for service in _service_cache.values():
        service.close()
    _service_cache.clear()


def clear_plan_cache() -> None:
    """Forget the cached reshard plans."""
    _plan_cache.clear()


def clear_all_caches() -> None:
    """Clear both the service and the plan caches."""
    clear_service_cache()
    clear_plan_cache()


def _first(model: Any) -> Any:
    return model[0] if isinstance(model, (list, tuple)) else model


def _unwrap_model_cores(src_model: Any, target_model: Any) -> tuple[Any, Any, int | None]:
    """``(source core, target core, num_experts)``; fills a missing source DP group from ``parallel_state``."""
    cores, num_experts = [], None
    for which, model in (("Source", src_model), ("Target", target_model)):
        if model is None:
            cores.append(None)
            continue
        lm = _first(model)
        if num_experts is None:
            num_experts = getattr(getattr(lm, "config", None), "num_moe_experts", None)
        core = unwrap_model(lm)
        if getattr(core, "pg_collection", None) is None:
            raise RuntimeError(f"{which} model has no pg_collection, which resharding needs")
        if which == "Source" and core.pg_collection.dp is None and parallel_state.model_parallel_is_initialized():
            core.pg_collection.dp = parallel_state.get_data_parallel_group()
        cores.append(core)
    return cores[0], cores[1], num_experts


def _build_or_get_plan(src_core: Any, tgt_core: Any, num_experts: int | None, group: Any, src_rank_offset: int,
                       dst_rank_offset: int, pool_index: int = 0) -> ReshardPlan:
    key = _PlanCacheKey(
        rank=group.rank() if group is not None else dist.get_rank(), src_config=_config_tuple(src_core),
        dst_config=_config_tuple(tgt_core), num_experts=num_experts,
        world_size=group.size() if group is not None else dist.get_world_size(),
        src_rank_offset=src_rank_offset, dst_rank_offset=dst_rank_offset, pool_index=pool_index)
    if key not in _plan_cache:
        _plan_cache[key] = build_local_reshard_plan(src_core, tgt_core, num_experts=num_experts, group=group,
                                                    src_rank_offset=src_rank_offset, dst_rank_offset=dst_rank_offset)
    return _plan_cache[key]


def _check_no_mxfp8(target_model: Any) -> None:
    config = getattr(_first(target_model), "config", None) if target_model is not None else None
    if (getattr(config, "transformer_impl", None) == "inference_optimized"
            and getattr(config, "fp8_recipe", None) == "mxfp8"):
        raise ImportError("refit into an MXFP8 'inference_optimized' model needs FlashInfer MXFP8 weights, "
                          "which this library does not provide")


def prepare_swap_model_weights(src_model: Any, target_model: Any, group: Any = None, src_rank_offset: int = 0,
                               dst_rank_offset: int = 0) -> None:
    """Build and cache the reshard plan ahead of the first :func:`swap_model_weights` (collective)."""
    _check_no_mxfp8(target_model)
    src_core, tgt_core, num_experts = _unwrap_model_cores(src_model, target_model)
    _build_or_get_plan(src_core, tgt_core, num_experts, group, src_rank_offset, dst_rank_offset)


def swap_model_weights(src_model: Any, target_model: Any, refit_method: RefitBackendName | CopyService,
                       group: Any = None, src_rank_offset: int = 0, dst_rank_offset: int = 0,
                       transform: ReshardTransform | None = None, num_dst_pools: int = 1,
                       dst_pool_index: int = 0) -> None:
    """Copy ``src_model``'s weights into ``target_model`` over ``refit_method`` (collective over ``group``).

    Either model may be ``None`` on ranks that hold only the other (or neither); ``*_rank_offset`` shift the
    models' group ranks into ``group``'s numbering. With ``num_dst_pools`` > 1, one pass per destination
    pool runs and this rank receives only in pass ``dst_pool_index``.
    """
    if isinstance(refit_method, str):
        service = get_or_create_service(refit_method, group=group)
    elif isinstance(refit_method, CopyService):
        service = refit_method
    else:
        raise TypeError(f"refit_method must be a backend name or a CopyService, got {type(refit_method).__name__}")
    for pool in range(num_dst_pools):
        target = target_model if pool == dst_pool_index else None
        pass_transform = transform
        if pass_transform is None:
            src_core, tgt_core, num_experts = _unwrap_model_cores(src_model, target)
            plan = _build_or_get_plan(src_core, tgt_core, num_experts, group, src_rank_offset, dst_rank_offset,
                                      pool)
            pass_transform = plan.transform
        reshard_model_weights(src_model, target, service=service, group=group, src_rank_offset=src_rank_offset,
                              dst_rank_offset=dst_rank_offset, transform=pass_transform, pool_index=pool)


def _harmonize_buffer_dtypes(plan: ReshardPlan, src_core: Any, tgt_core: Any, group: Any = None) -> None:
    """Cast destination persistent buffers to the source's dtype (collective the first time per plan)."""
    if plan.buffer_dtypes is None:
        mine = {} if src_core is None else {n: b.dtype for n, _m, _b, b in named_persistent_buffers(src_core)}
        gathered: list = [None] * (group.size() if group is not None else dist.get_world_size())
        dist.all_gather_object(gathered, mine, group=group)
        plan.buffer_dtypes = {}
        for part in gathered:
            for name, dtype in (part or {}).items():
                plan.buffer_dtypes.setdefault(name, dtype)
    if tgt_core is None:
        return
    changed = False
    for name, module, buf_name, buf in list(named_persistent_buffers(tgt_core)):
        want = plan.buffer_dtypes.get(name)
        if want is not None and buf.dtype != want:
            module._buffers[buf_name] = buf.to(want)
            changed = True
    if changed:
        invalidate_refit_tensor_cache(tgt_core)


def reshard_model_weights(src_model: Any, target_model: Any, service: CopyService, group: Any = None,
                          src_rank_offset: int = 0, dst_rank_offset: int = 0,
                          transform: ReshardTransform | None = None, pool_index: int = 0) -> None:
    """Plan (cached) and run the copy of ``src_model``'s weights into ``target_model`` over ``service``."""
    _check_no_mxfp8(target_model)
    src_core, tgt_core, num_experts = _unwrap_model_cores(src_model, target_model)
    plan = _build_or_get_plan(src_core, tgt_core, num_experts, group, src_rank_offset, dst_rank_offset, pool_index)
    _harmonize_buffer_dtypes(plan, src_core, tgt_core, group=group)
    execute_reshard_plan(plan, src_core, tgt_core, service=service, group=group, transform=transform)
