"""``DistributedDataParallelConfig``: how gradients are reduced and parameters gathered across data parallel ranks.

Mirrors Megatron-Core's dataclass of the same name. ``use_megatron_fsdp=True`` selects the
Megatron-FSDP entry point (``distributed.fsdp.FullyShardedDataParallel``, built here on our DDP,
distributed optimizer and FSDP2 wrappers); its options that have no counterpart there are refused by
:func:`~megatron_core.distributed.megatron_fsdp_options.check_megatron_fsdp_options`. FP4 parameter
gathers are rejected with a ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from megatron_core.distributed.megatron_fsdp_options import check_megatron_fsdp_options

_SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")



class DDPConfigError(ValueError, AssertionError):
    """An invalid combination of ``DistributedDataParallelConfig`` fields where Megatron-Core asserts."""

@dataclass
class DistributedDataParallelConfig:
    """Settings of :class:`~megatron_core.distributed.DistributedDataParallel`."""

    grad_reduce_in_fp32: bool = False
    """Keep ``main_grad`` buffers (and reduce them) in fp32 whatever the parameter dtype."""

    overlap_grad_reduce: bool = False
    """Launch each bucket's reduction as soon as all of its gradients are ready during backward."""

    overlap_param_gather: bool = False
    """Distributed optimizer: all-gather updated parameters lazily, overlapped with the next forward."""

    align_param_gather: bool = False
    """Let the pipeline schedule dispatch parameter all-gathers (all stages at once)."""

    use_distributed_optimizer: bool = False
    """Reduce-scatter gradients and all-gather parameters (ZeRO-1) instead of all-reducing gradients."""

    num_distributed_optimizer_instances: int = 1
    """Shard the optimizer over DP / instances ranks and all-reduce across the instances."""

    check_for_nan_in_grad: bool = False
    """Raise before reducing a bucket whose local gradients contain NaN or Inf."""

    check_for_large_grads: bool = False
    """Raise before reducing a bucket whose local gradient norm exceeds ``large_grad_threshold``."""

    large_grad_threshold: float = 1e10
    """Threshold used by ``check_for_large_grads`` (not in Megatron-Core, which fixes it internally)."""

    bucket_size: int | None = None
    """Elements per bucket; default ``max(40_000_000, 1_000_000 * dp_size)`` when overlapping, else one bucket."""

    num_buckets: int | None = None
    """Alternative to ``bucket_size``: split each buffer into about this many buckets."""

    pad_buckets_for_high_nccl_busbw: bool = False
    """Pad each bucket to a multiple of 2**16 elements (and DP size) for better NCCL bus bandwidth."""

    reduce_scatter_with_fp32_accumulation: bool = False
    """Reduce-scatter gradients (distributed optimizer) by an all-to-all and an fp32 local sum, so low-precision
    grads are added in fp32; no effect on all-reduce (see ``reduce_scatter_with_fp32_accumulation.py``)."""

    param_name_patterns_for_fp32_local_accumulation: tuple[str, ...] = ()
    """Accepted for compatibility; must be empty when ``grad_reduce_in_fp32`` is set."""

    average_in_collective: bool = False
    """Average with ``ReduceOp.AVG`` in the collective instead of pre-scaling by 1/DP."""

    fp8_param_gather: bool = False
    """All-gather FP8 parameters (``fp8_param``) as their 1-byte values; needs ``use_distributed_optimizer``, and a
    model with FP8 parameters needs it (see :mod:`megatron_core.distributed.fp8_params`)."""

    fp4_param_gather: bool = False
    """FP4 parameter all-gather (Transformer Engine only; rejected here)."""

    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    """MXFP8 buffer reuse (Transformer Engine only; rejected here)."""

    use_megatron_fsdp: bool = False
    """Megatron-FSDP: wrap the model in ``distributed.fsdp.FullyShardedDataParallel`` (checked here, see the module
    docstring); ``data_parallel_sharding_strategy`` picks what is sharded and ``use_distributed_optimizer`` is
    then implied by it."""

    use_custom_fsdp: bool = False
    """Deprecated alias of ``use_megatron_fsdp``."""

    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = "no_shard"
    """Megatron-FSDP sharding: ``no_shard`` (all-reduced gradients), ``optim`` (ZeRO-1), ``optim_grads`` (ZeRO-2),
    ``optim_grads_params`` (ZeRO-3, FSDP2); only meaningful with ``use_megatron_fsdp``."""

    gradient_reduce_div_fusion: bool = True
    """FSDP option, accepted for compatibility."""

    suggested_communication_unit_size: int | None = None
    """Megatron-FSDP communication granularity (elements); accepted and ignored (FSDP2 gathers one unit at a time)."""

    keep_fp8_transpose_cache: bool = False
    """Megatron-FSDP FP8 transpose cache (Transformer Engine); ``True`` is refused."""

    fsdp_double_buffer: bool = False
    """Megatron-FSDP persistent double buffers for its collectives; ``True`` is refused."""

    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    """Megatron-FSDP double-buffer fallback; accepted and ignored (no double buffers here)."""

    fsdp_all_gather_in_start_param_sync: bool = True
    """Megatron-FSDP: gather the first bucket in ``start_param_sync``; accepted and ignored."""

    outer_dp_sharding_strategy: str = "no_shard"
    """Megatron-FSDP HSDP sharding over the outer DP group (``num_distributed_optimizer_instances > 1``):
    ``no_shard`` or ``optim`` (refused here)."""

    disable_symmetric_registration: bool = False
    """NCCL user-buffer registration mode; accepted and ignored (``nccl_ub`` is refused)."""

    fsdp_manual_registration: bool = False
    """Megatron-FSDP manual NCCL user-buffer registration; ``True`` is refused (needs ``nccl_ub``)."""

    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    """Megatron-FSDP main-weight dtype; only ``torch.float32`` (the optimizer's fp32 main weights) is supported."""

    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    """Megatron-FSDP main-gradient dtype: ``None`` (the parameters' dtype, or ``grad_reduce_in_fp32``) or
    ``torch.float32`` (reduce in fp32, like ``grad_reduce_in_fp32=True``)."""

    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    """Megatron-FSDP gradient-communication dtype: ``None`` or ``megatron_fsdp_main_grads_dtype``."""

    megatron_fsdp_use_decoupled_grad: bool = False
    """Megatron-FSDP decoupled gradients for Transformer Engine's FusedAdam; ``True`` is refused."""

    megatron_fsdp_cuda_graph_mode: bool = False
    """Megatron-FSDP CUDA-graph-safe mode; ``True`` is refused."""

    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    """Megatron-FSDP per-submodule parameter gathers (MXFP8 recompute); ``True`` is refused."""

    megatron_fsdp_max_pool_double_buffer: bool = False
    """Megatron-FSDP max-pool double buffer (implies ``fsdp_double_buffer``); ``True`` is refused."""

    nccl_ub: bool = False
    """NCCL user buffers (rejected: needs NCCL symmetric memory)."""

    delay_wgrad_compute: bool = False
    """Accepted (Megatron-Core's switch for deferred weight gradients). Either value works: DDP finds the deferred
    weights by their ``skip_backward_post_hook`` mark (set by the layers under the model config's
    ``delay_wgrad_compute`` / ``overlap_dispatch_backward_with_experts_wgrad``) and fires their grad-ready hooks
    from the layers' ``backward_dw()``."""

    overwrite_main_grad_on_first_wgrad: bool = False
    """Our extension (not in Megatron-Core): ``zero_grad_buffer()`` leaves unzeroed the ``main_grad`` of weights
    whose gradient only arrives through the fused weight-gradient GEMM (marked ``wgrad_fused_into_main_grad``,
    i.e. ``gradient_accumulation_fusion`` is on), and the first GEMM of the step writes it (beta = 0) instead of
    adding; everything else is zeroed as before, and a weight that got no GEMM is zeroed before its bucket is
    reduced. Not for backward passes captured in a CUDA graph (raises)."""

    def __post_init__(self) -> None:
        """Validate the combination of options; errors name the fields and values."""
        if self.use_custom_fsdp:
            self.use_megatron_fsdp = True
        if self.megatron_fsdp_max_pool_double_buffer:
            self.fsdp_double_buffer = True  # 0.19: the max-pool allocator is a kind of double buffer
        if self.data_parallel_sharding_strategy not in _SHARDING_STRATEGIES:
            raise ValueError(
                f"data_parallel_sharding_strategy ({self.data_parallel_sharding_strategy!r}) must be one of "
                f"{_SHARDING_STRATEGIES}"
            )
        if self.use_megatron_fsdp:
            check_megatron_fsdp_options(self)
        # Megatron-FSDP decides from data_parallel_sharding_strategy what is sharded, not use_distributed_optimizer.
        sharded = self.use_distributed_optimizer or self.use_megatron_fsdp
        if self.fp8_param_gather and not self.use_distributed_optimizer:
            raise ValueError("fp8_param_gather=True needs use_distributed_optimizer=True (the FP8 parameters' "
                             "bytes are all-gathered from the distributed optimizer's shards)")
        for name in ("fp4_param_gather", "reuse_grad_buf_for_mxfp8_param_ag", "nccl_ub"):
            if getattr(self, name):
                raise ValueError(f"{name}=True needs Transformer Engine / NCCL user buffers, not supported here")
        if self.num_buckets is not None and self.bucket_size is not None:
            raise ValueError(
                f"num_buckets ({self.num_buckets}) and bucket_size ({self.bucket_size}) are exclusive; set one"
            )
        if self.num_buckets is not None and self.num_buckets <= 0:
            raise ValueError(f"num_buckets ({self.num_buckets}) must be > 0")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"bucket_size ({self.bucket_size}) must be > 0")
        if self.param_name_patterns_for_fp32_local_accumulation and self.grad_reduce_in_fp32:
            raise DDPConfigError(
                "param_name_patterns_for_fp32_local_accumulation "
                f"({self.param_name_patterns_for_fp32_local_accumulation}) cannot be combined with "
                "grad_reduce_in_fp32=True"
            )
        if self.overlap_param_gather and not sharded:
            raise ValueError("overlap_param_gather=True needs use_distributed_optimizer=True (or use_megatron_fsdp)")
        if self.align_param_gather and not self.overlap_param_gather:
            raise ValueError("align_param_gather=True needs overlap_param_gather=True")
        if self.num_distributed_optimizer_instances < 1:
            raise ValueError(
                f"num_distributed_optimizer_instances ({self.num_distributed_optimizer_instances}) must be >= 1"
            )
        if self.num_distributed_optimizer_instances > 1 and self.reduce_scatter_with_fp32_accumulation:
            raise ValueError(
                f"reduce_scatter_with_fp32_accumulation=True is not supported with num_distributed_optimizer_instances "
                f"({self.num_distributed_optimizer_instances}) > 1"
            )
        if self.num_distributed_optimizer_instances > 1 and not sharded:
            raise ValueError(
                f"num_distributed_optimizer_instances ({self.num_distributed_optimizer_instances}) > 1 needs "
                "use_distributed_optimizer=True"
            )
