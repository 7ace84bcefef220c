"""Which Megatron-FSDP options of ``DistributedDataParallelConfig`` this library serves, and how.

Megatron-Core 0.19's Megatron-FSDP (``use_megatron_fsdp=True``) is its own sharding runtime with its
own buffers. Here ``distributed.fsdp.FullyShardedDataParallel`` maps each sharding strategy onto the
wrappers the library already has (``no_shard`` / ``optim`` / ``optim_grads``: ``DistributedDataParallel``,
with the distributed optimizer for the last two; ``optim_grads_params``: ``TorchFullyShardedDataParallel``),
so the options that describe Megatron-FSDP's own allocators, NCCL registration, CUDA-graph or
Transformer Engine paths have no counterpart: setting them raises a ``ValueError`` naming the field,
its value and the rule. Pure tuning knobs of those buffers are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MEGATRON_FSDP_FIELDS", "check_megatron_fsdp_options"]

MEGATRON_FSDP_FIELDS = (
    "use_megatron_fsdp", "use_custom_fsdp", "data_parallel_sharding_strategy", "suggested_communication_unit_size",
    "keep_fp8_transpose_cache", "fsdp_double_buffer", "fsdp_db_use_persist_buf_on_alloc_fail",
    "fsdp_all_gather_in_start_param_sync", "outer_dp_sharding_strategy", "disable_symmetric_registration",
    "fsdp_manual_registration", "megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype",
    "megatron_fsdp_grad_comm_dtype", "megatron_fsdp_use_decoupled_grad", "megatron_fsdp_cuda_graph_mode",
    "megatron_fsdp_enable_fine_grained_param_gather", "megatron_fsdp_max_pool_double_buffer",
)
"""The ``DistributedDataParallelConfig`` fields that only Megatron-FSDP reads."""

_OUTER_STRATEGIES = ("no_shard", "optim")

# Options that select a Megatron-FSDP machinery with no counterpart here: refused when True.
_REFUSED_FLAGS = {
    "megatron_fsdp_max_pool_double_buffer": "a double-buffer allocator of Megatron-FSDP's own (it sets "
                                            "fsdp_double_buffer)",
    "fsdp_double_buffer": "persistent double buffers belong to Megatron-FSDP's own allocator",
    "fsdp_manual_registration": "needs nccl_ub (NCCL user buffers), not supported here",
    "keep_fp8_transpose_cache": "needs Transformer Engine FP8 parameters, not supported under Megatron-FSDP here",
    "megatron_fsdp_use_decoupled_grad": "needs Transformer Engine's FusedAdam decoupled gradients",
    "megatron_fsdp_cuda_graph_mode": "CUDA graphs are not supported with Megatron-FSDP here",
    "megatron_fsdp_enable_fine_grained_param_gather": "per-submodule gathers are not supported (FSDP2 gathers "
                                                      "one unit at a time)",
    "fp8_param_gather": "FP8 parameters are not supported with Megatron-FSDP here",
}


def check_megatron_fsdp_options(config: Any) -> None:
    """Raise ``ValueError`` for a Megatron-FSDP setting of ``config`` (a ``DistributedDataParallelConfig``) that
    ``FullyShardedDataParallel`` cannot serve; return quietly otherwise."""
    strategy = config.data_parallel_sharding_strategy
    for name, why in _REFUSED_FLAGS.items():
        if getattr(config, name):
            raise ValueError(f"{name}=True is not supported with use_megatron_fsdp / FullyShardedDataParallel: {why}")
    outer = config.outer_dp_sharding_strategy
    if outer not in _OUTER_STRATEGIES:
        raise ValueError(f"outer_dp_sharding_strategy ({outer!r}) must be one of {_OUTER_STRATEGIES}")
    if outer != "no_shard":
        raise ValueError(f"outer_dp_sharding_strategy={outer!r} (optimizer sharding across the outer HSDP group) is "
                         "not supported; use 'no_shard'")
    instances = config.num_distributed_optimizer_instances
    if instances > 1 and strategy not in ("optim", "optim_grads"):
        raise ValueError(f"num_distributed_optimizer_instances ({instances}) > 1 (HSDP) needs "
                         f"data_parallel_sharding_strategy 'optim' or 'optim_grads', got {strategy!r}")
    if config.megatron_fsdp_main_params_dtype != torch.float32:
        raise ValueError(f"megatron_fsdp_main_params_dtype ({config.megatron_fsdp_main_params_dtype}) must be "
                         "torch.float32: the optimizer always keeps fp32 main weights here")
    grads = config.megatron_fsdp_main_grads_dtype
    if grads not in (None, torch.float32):
        raise ValueError(f"megatron_fsdp_main_grads_dtype ({grads}) must be None or torch.float32")
    comm = config.megatron_fsdp_grad_comm_dtype
    if comm is not None and comm != grads:
        raise ValueError(f"megatron_fsdp_grad_comm_dtype ({comm}) must be None or equal to "
                         f"megatron_fsdp_main_grads_dtype ({grads}): gradients are reduced in their own dtype")
