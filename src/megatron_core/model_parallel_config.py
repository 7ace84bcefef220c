"""``ModelParallelConfig``: the parallelism, precision and schedule-hook settings shared by every module.

Mirrors Megatron-Core's dataclass of the same name (field names and defaults); the fields of features this
library lacks come from :mod:`megatron_core.megatron_only_fields`. ``TransformerConfig`` extends it. The schedule hooks (``no_sync_func``, ``grad_sync_func``, ``finalize_model_grads_func``,
...) are set by the training loop and called by ``pipeline_parallel``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.megatron_only_fields import MegatronOnlyParallelFields as _MegatronOnlyParallelFields
from megatron_core.megatron_only_fields import check_megatron_only_fields as _check_megatron_only_fields


def resolve_tensor_parallel_weight_shards(
    tensor_model_parallel_size: int,
    tensor_parallel_num_weight_shards: int | None,
    gtp_weight_remat_size: int,
    shards_field: str = "tensor_parallel_num_weight_shards",
    tp_field: str = "tensor_model_parallel_size",
) -> tuple[int, int]:
    """Make the weight-shard count and the GTP remat size agree: ``(num_weight_shards, gtp_weight_remat_size)``.

    The shard count (how many pieces each weight is cut into over the TP and GTP axes together) wins
    when given: it must be a multiple of the TP size, at least the TP size, and the remat size becomes
    ``num_weight_shards // tensor_model_parallel_size``. When it is ``None`` it is derived as
    ``tensor_model_parallel_size * gtp_weight_remat_size``. Applying the result again changes nothing.
    ``shards_field`` / ``tp_field`` name the options in error messages (e.g. the expert variants).
    """
    if tensor_model_parallel_size < 1:
        raise ValueError(f"{tp_field} must be >= 1, got {tensor_model_parallel_size}")
    if tensor_parallel_num_weight_shards is None:
        return tensor_model_parallel_size * gtp_weight_remat_size, gtp_weight_remat_size
    if tensor_parallel_num_weight_shards < tensor_model_parallel_size:
        raise ValueError(
            f"{shards_field} ({tensor_parallel_num_weight_shards}) must be >= {tp_field} "
            f"({tensor_model_parallel_size})"
        )
    if tensor_parallel_num_weight_shards % tensor_model_parallel_size:
        raise ValueError(
            f"{shards_field} ({tensor_parallel_num_weight_shards}) must be divisible by {tp_field} "
            f"({tensor_model_parallel_size})"
        )
    return tensor_parallel_num_weight_shards, tensor_parallel_num_weight_shards // tensor_model_parallel_size


@dataclass
class ModelParallelConfig(_MegatronOnlyParallelFields):
    """Parallel sizes, initialization, precision, pipeline and communication-overlap settings."""

    # Parallel sizes
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_comm_backend: str | None = None
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    hierarchical_context_parallel_sizes: list[int] | None = None
    # Longest sub-sample one DP x CP rank holds; sets sub-sample CP sizes in datasets.data_schedule.
    max_seqlen_per_dp_cp_rank: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None

    # Initialization
    perform_initialization: bool = True
    use_cpu_initialization: bool = False

    # Precision
    fp16: bool = False
    bf16: bool = False
    params_dtype: torch.dtype = torch.float32
    enable_autocast: bool = False
    autocast_dtype: torch.dtype | None = None
    deterministic_mode: bool = False

    # Training hooks, set by the training loop and called by the schedules
    timers: Any = None
    finalize_model_grads_func: Callable | None = None
    grad_scale_func: Callable | None = None
    moe_grad_scale_func: Callable | None = None
    mtp_grad_scale_func: Callable | None = None  # the MTP losses' backward scale (else grad_scale_func)
    no_sync_func: Callable | None = None
    grad_sync_func: Callable | None = None
    param_sync_func: Callable | None = None

    # Activation checkpointing by microbatch
    num_microbatches_with_partial_activation_checkpoints: int | None = None

    # Optimizations
    gradient_accumulation_fusion: bool = False
    async_tensor_model_parallel_allreduce: bool = False
    use_te_rng_tracker: bool = False
    tp_comm_overlap: bool = False

    # Loss
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"

    # Pipeline
    pipeline_dtype: torch.dtype | None = None
    variable_seq_lengths: bool = False
    overlap_p2p_comm: bool = False
    batch_p2p_comm: bool = True
    batch_p2p_sync: bool = True
    use_ring_exchange_p2p: bool = False
    deallocate_pipeline_outputs: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    overlap_p2p_comm_warmup_flush: bool = False
    microbatch_group_size_per_vp_stage: int | None = None

    # CPU offloading
    cpu_offloading: bool = False
    cpu_offloading_num_layers: int = 0

    # Timing
    barrier_with_L1_time: bool = True

    def __post_init__(self) -> None:
        """Validate sizes and fill derived defaults; errors name the fields, values and rule."""
        _check_megatron_only_fields(type(self).__name__, self)
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} ({value!r}) must be an integer >= 1")
        seqlen = self.max_seqlen_per_dp_cp_rank
        if seqlen is not None and (not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1):
            raise ValueError(f"max_seqlen_per_dp_cp_rank ({seqlen!r}) must be None or an integer >= 1")
        if self.hybrid_context_parallel and seqlen is None:
            raise ValueError("hybrid_context_parallel=True needs max_seqlen_per_dp_cp_rank (None): the longest "
                             "sub-sample one DP x CP rank holds, which sets each sub-sample's CP size")
        if self.hybrid_context_parallel and self.pipeline_model_parallel_size > 1:
            raise ValueError("hybrid_context_parallel=True is not supported with pipeline parallelism "
                             f"(pipeline_model_parallel_size={self.pipeline_model_parallel_size}; must be 1)")
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise ValueError(
                f"Cannot use sequence parallelism without tensor parallelism: sequence_parallel=True needs "
                f"tensor_model_parallel_size > 1 (got {self.tensor_model_parallel_size})"
            )
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.pipeline_model_parallel_size > 1 and self.pipeline_dtype is None:
            raise ValueError(
                f"pipeline_dtype must be set when pipeline_model_parallel_size > 1 "
                f"(got pipeline_model_parallel_size={self.pipeline_model_parallel_size}, pipeline_dtype=None)"
            )
        if self.virtual_pipeline_model_parallel_size is not None and self.pipeline_model_parallel_size <= 1:
            raise ValueError(
                f"virtual_pipeline_model_parallel_size ({self.virtual_pipeline_model_parallel_size}) needs "
                f"pipeline_model_parallel_size > 1 (got {self.pipeline_model_parallel_size})"
            )
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 cannot both be True")
        if self.autocast_dtype is None:
            self.autocast_dtype = self.params_dtype
        if self.defer_embedding_wgrad_compute and self.pipeline_model_parallel_size <= 1:
            raise ValueError("defer_embedding_wgrad_compute needs pipeline_model_parallel_size > 1")
        if self.cross_entropy_fusion_impl not in ("native", "te"):
            raise ValueError(f"cross_entropy_fusion_impl ({self.cross_entropy_fusion_impl!r}) must be 'native' or 'te'")
        if self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "te":
            # Megatron-Core's warning; this library has no TE kernel and runs the native fused one (same loss).
            warnings.warn("Transformer Engine cross entropy loss fusion has known stability issues. Use "
                          "cross_entropy_fusion_impl='native', or disable cross_entropy_loss_fusion. (This library "
                          "runs its native fused cross entropy for 'te'.)", UserWarning, stacklevel=3)
        if self.overlap_p2p_comm_warmup_flush and (not self.overlap_p2p_comm or self.batch_p2p_comm):
            raise ValueError(
                "overlap_p2p_comm_warmup_flush needs overlap_p2p_comm=True and batch_p2p_comm=False "
                f"(got overlap_p2p_comm={self.overlap_p2p_comm}, batch_p2p_comm={self.batch_p2p_comm})"
            )
