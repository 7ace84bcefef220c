"""Contiguous parameter and gradient buffers, split into buckets that are reduced as one collective.

Megatron-Core's ``_ParamAndGradBuffer``. Parameters of one (param dtype, grad dtype) pair are laid
out in **reverse creation order** (roughly the order backward produces their gradients), so a
bucket at the front of the buffer fills first. Every parameter gets ``param.main_grad``, a view
into the gradient buffer; with the distributed optimizer ``param.data`` also becomes a view into
the parameter buffer (the raw bytes, ``uint8``, of FP8 parameters: :mod:`megatron_core.distributed.fp8_params`), and
each bucket is padded so that it splits into equal per-rank shards
(rank ``r`` owns elements ``[r * n, (r + 1) * n)`` of every bucket).

A buffer holding Transformer Engine NVFP4 parameters (:mod:`megatron_core.fp4_utils`) has two index maps: the
gradient buffer keeps ``param_index_map`` (full element counts) while the parameter buffer holds their packed
row-wise bytes, two values per byte, placed by ``nvfp4_packed_param_index_map``
(:func:`~megatron_core.distributed.param_layout.compute_nvfp4_packed_layout`).

With ``overwrite_main_grad_on_first_wgrad`` the ``main_grad`` of a weight written only by the fused
weight-gradient GEMM is not zeroed between steps: it is registered as awaiting its first write
(:mod:`~megatron_core.tensor_parallel.wgrad_accumulation`), and a bucket group zeroes whichever of its
own are still pending before it reads or reduces them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from enum import Enum
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core._misc_utils import log_on_each_pipeline_stage
from megatron_core.device import get_current_device
from megatron_core.distributed import collectives
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.fp8_params import FP8_PARAM_BUFFER_DTYPE, is_fp8_param
from megatron_core.distributed.param_layout import (
    BufferKey,
    FullParamLayout,
    PerBufferParamLayout,
    compute_nvfp4_packed_layout,
    compute_per_buffer_param_layout,
)
from megatron_core.fp4_utils import (
    get_nvfp4_rowwise_packed_shape,
    is_grouped_nvfp4tensor,
    is_nvfp4tensor,
    modify_grouped_nvfp4_rowwise_storage,
    modify_nvfp4_rowwise_storage,
)
from megatron_core.tensor_parallel.wgrad_accumulation import expect_first_write, zero_pending_first_writes

logger = logging.getLogger(__name__)


class BufferType(Enum):
    """Which of the two buffers a range refers to."""

    PARAM = 1
    GRAD = 2


def _written_only_by_wgrad_gemm(param: torch.nn.Parameter) -> bool:
    """Whether ``param``'s gradient only ever reaches ``main_grad`` through the fused weight-gradient GEMM.

    True for weights marked ``wgrad_fused_into_main_grad`` (``gradient_accumulation_fusion``): DDP's
    backward hook ignores their ``.grad``, unless ``zero_out_wgrad`` (a tied embedding whose lookup
    gradient arrives as ``.grad``) makes the hook add it.
    """
    return bool(getattr(param, "wgrad_fused_into_main_grad", False)) and not getattr(param, "zero_out_wgrad", False)


def _is_nvfp4_param(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is a Transformer Engine NVFP4 tensor, plain or grouped (its bytes packed two per byte)."""
    return is_nvfp4tensor(param) or is_grouped_nvfp4tensor(param)


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> list[torch.Tensor]:
    """Split a 1-D buffer into ``data_parallel_world_size`` equal contiguous views."""
    if buffer.numel() % data_parallel_world_size != 0:
        raise ValueError(f"buffer of {buffer.numel()} elements does not split into {data_parallel_world_size} shards")
    n = buffer.numel() // data_parallel_world_size
    return [buffer[r * n:(r + 1) * n] for r in range(data_parallel_world_size)]


class _ParamAndGradBucket:
    """A contiguous slice of a buffer whose gradients are reduced (and params gathered) together."""

    def __init__(self, params: list[torch.nn.Parameter], param_data: torch.Tensor | None,
                 grad_data: torch.Tensor, offset: int, numel_unpadded: int,
                 gradient_scaling_factor: float, bucket_id: int,
                 first_write_main_grads: list[torch.Tensor] | None = None) -> None:
        self.params_list = params
        self.params = set(params)
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id
        # main_grads left unzeroed at reset (overwrite_main_grad_on_first_wgrad): zeroed before the bucket is read
        # if no weight-gradient GEMM wrote them.
        self.first_write_main_grads = first_write_main_grads or []


class _ParamAndGradBucketGroup:
    """Buckets whose gradient reduction and parameter all-gather are launched together.

    Tracks which params reported a ready gradient (when overlapping) and owns the async handles.
    """

    def __init__(self, buckets: list[_ParamAndGradBucket], ddp_config: DistributedDataParallelConfig,
                 collective_group: dist.ProcessGroup | None, collective_group_size: int) -> None:
        self.buckets = buckets
        self.ddp_config = ddp_config
        self.data_parallel_group = collective_group
        self.data_parallel_world_size = collective_group_size
        self.data_parallel_rank = get_pg_rank(collective_group)
        self.params = set().union(*(b.params for b in buckets))
        self.first_write_main_grads = [g for b in buckets for g in b.first_write_main_grads]
        self.params_with_grad: set[torch.nn.Parameter] = set()
        self.is_last_microbatch = True
        self.grad_reduce_handles: list | None = None
        self.param_gather_handles: list | None = None
        self.param_gather_dispatched = False
        self.next_param_gather_bucket_group: _ParamAndGradBucketGroup | None = None
        # num_distributed_optimizer_instances > 1: after the reduction over ``collective_group`` (one instance's
        # ranks) each rank's shard is all-reduced over this group (the same shard in every instance).
        self.inter_distributed_optimizer_instance_group: dist.ProcessGroup | None = None

    def reset(self) -> None:
        """Forget ready gradients before the next iteration."""
        self.is_last_microbatch = True
        self.params_with_grad = set()

    def check_grads(self) -> None:
        """Raise if a bucket's local gradients are non-finite (or too large), before communicating."""
        for bucket in self.buckets:
            norm = bucket.grad_data.float().norm(p=2)
            rank = dist.get_rank() if dist.is_initialized() else 0
            if self.ddp_config.check_for_nan_in_grad and not torch.isfinite(norm):
                raise RuntimeError(
                    f"Rank {rank}: found NaN or Inf in local gradients of bucket {bucket.bucket_id} "
                    f"(norm {norm.item()}) before the data-parallel reduction"
                )
            if self.ddp_config.check_for_large_grads and norm.item() > self.ddp_config.large_grad_threshold:
                raise RuntimeError(
                    f"Rank {rank}: local gradient norm {norm.item():.3e} of bucket {bucket.bucket_id} exceeds "
                    f"large_grad_threshold ({self.ddp_config.large_grad_threshold:.3e})"
                )

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Scale and launch the reduction of every bucket (async when ``overlap_grad_reduce``)."""
        if self.grad_reduce_handles is not None:
            raise RuntimeError("a gradient reduction is already outstanding for this bucket group")
        zero_pending_first_writes(self.first_write_main_grads)
        if self.ddp_config.check_for_nan_in_grad or self.ddp_config.check_for_large_grads:
            self.check_grads()
        op = "avg" if self.ddp_config.average_in_collective else "sum"
        async_op = self.ddp_config.overlap_grad_reduce
        reduce_scatter = self.ddp_config.use_distributed_optimizer and not force_all_reduce
        handles = []
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data.mul_(bucket.gradient_scaling_factor)
            if reduce_scatter:
                local = shard_buffer(bucket.grad_data, self.data_parallel_world_size)[self.data_parallel_rank]
                handle = collectives.reduce_scatter(
                    local, bucket.grad_data, self.data_parallel_group, op=op, async_op=async_op,
                    fp32_accumulation=self.ddp_config.reduce_scatter_with_fp32_accumulation)
            else:
                local = bucket.grad_data
                handle = collectives.all_reduce(local, self.data_parallel_group, op=op, async_op=async_op)
            if self.inter_distributed_optimizer_instance_group is not None:
                # The cross-instance all-reduce reads the intra-instance result: wait for it first (on CUDA this
                # orders the streams; the host returns at once).
                if handle is not None:
                    handle.wait()
                handle = collectives.all_reduce(local, self.inter_distributed_optimizer_instance_group, op=op,
                                                async_op=async_op)
            handles.append(handle)
        self.grad_reduce_handles = [h for h in handles if h is not None]

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Wait for the reduction (launching it synchronously first when not overlapping)."""
        self.param_gather_dispatched = False
        zero_pending_first_writes(self.first_write_main_grads)
        if not self.ddp_config.overlap_grad_reduce or force_all_reduce:
            if self.grad_reduce_handles is None:
                self.start_grad_sync(force_all_reduce=force_all_reduce)
        if self.grad_reduce_handles is None:
            raise RuntimeError(
                f"the gradient reduction of this bucket group was never launched "
                f"({len(self.params_with_grad)}/{len(self.params)} params have their gradient ready); "
                "does every parameter take part in the loss?"
            )
        for handle in self.grad_reduce_handles:
            handle.wait()
        self.grad_reduce_handles = None

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        """Mark ``param``'s gradient ready; launch the reduction once every param of the group is ready."""
        if not self.is_last_microbatch:
            return
        if param in self.params_with_grad:
            raise RuntimeError("a parameter's gradient was marked ready twice in one iteration")
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather every rank's updated shard into the param buffer (async with ``overlap_param_gather``)."""
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError("parameter all-gather needs use_distributed_optimizer=True")
        if force_sync:
            if self.param_gather_handles is not None:
                for handle in self.param_gather_handles:
                    handle.wait()
                self.param_gather_handles = None
                return
        elif self.param_gather_dispatched:
            raise RuntimeError("a parameter all-gather is already dispatched for this bucket group")
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        handles = []
        for bucket in self.buckets:
            local = shard_buffer(bucket.param_data, self.data_parallel_world_size)[self.data_parallel_rank]
            handles.append(collectives.all_gather(bucket.param_data, local, self.data_parallel_group,
                                                  async_op=async_op))
        self.param_gather_handles = [h for h in handles if h is not None] if async_op else None
        # Only the overlapped protocol has a gather in flight for the forward pre-hooks to wait on; a synchronous
        # gather leaves nothing dispatched (a replayed full-iteration CUDA graph skips finish_grad_sync's reset).
        self.param_gather_dispatched = self.ddp_config.overlap_param_gather

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Wait for this group's all-gather (dispatching it if needed), then dispatch the next group's."""
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handles is not None:
            for handle in self.param_gather_handles:
                handle.wait()
            self.param_gather_handles = None
            nxt = self.next_param_gather_bucket_group
            if nxt is not None and not skip_next_bucket_dispatch and not nxt.param_gather_dispatched:
                nxt.start_param_sync()


def group_params_for_buffers(params: list[torch.nn.Parameter], grad_reduce_in_fp32: bool,
                             ) -> dict[BufferKey, tuple[list[torch.nn.Parameter], list[int]]]:
    """Split ``params`` into DDP buffers: ``{BufferKey: (params, param_indices)}``, in first-seen order.

    A buffer holds the parameters of one (param dtype, grad dtype, expert-parallel, layer-wise) key; the
    grad dtype is fp32 with ``grad_reduce_in_fp32``, else the param dtype; expert parameters are those
    with ``allreduce == False``. FP8 parameters (``fp8_param``) have param dtype ``uint8`` (their bytes) and
    their high-precision dtype as grad dtype; so do Transformer Engine's NVFP4 parameters (their packed bytes,
    their logical dtype). ``param_indices`` numbers each parameter among those of its key.
    """
    groups: dict[BufferKey, tuple[list[torch.nn.Parameter], list[int]]] = {}
    for param in params:
        if not param.requires_grad:
            raise ValueError("group_params_for_buffers: every parameter must require grad")
        param_dtype, grad_dtype = param.dtype, param.dtype
        if is_fp8_param(param):  # its bytes in a 1-byte buffer; its gradient in its high-precision dtype
            param_dtype, grad_dtype = FP8_PARAM_BUFFER_DTYPE, param.fp8_hp_dtype
        elif _is_nvfp4_param(param):
            param_dtype = torch.uint8
        key = BufferKey(param_dtype, torch.float if grad_reduce_in_fp32 else grad_dtype,
                        not getattr(param, "allreduce", True),
                        bool(getattr(param, "is_managed_by_layer_wise_optimizer", False)))
        plist, indices = groups.setdefault(key, ([], []))
        indices.append(len(plist))
        plist.append(param)
    return groups


def compute_full_param_layout(params: list[torch.nn.Parameter], bucket_size: int | None,
                              data_parallel_world_size: int, ddp_config: Any,
                              expert_data_parallel_world_size: int | None = None) -> FullParamLayout:
    """The padded layout of every DDP buffer of ``params`` (grouped by ``group_params_for_buffers``).

    ``DistributedOptimizer.compute_full_param_layout`` (Megatron-Core's name) is this function.

    Expert-parallel buffers are padded for ``expert_data_parallel_world_size`` (default: the dense size).
    Pass the result to ``DistributedDataParallel(..., full_param_layout=)``.
    """
    from megatron_core.distributed.param_and_grad_buffer import group_params_for_buffers

    layouts = {}
    for key, (group_params, param_indices) in group_params_for_buffers(
            params, ddp_config.grad_reduce_in_fp32).items():
        dp_size = data_parallel_world_size
        if key.is_expert_parallel and expert_data_parallel_world_size is not None:
            dp_size = expert_data_parallel_world_size
        layouts[key] = compute_per_buffer_param_layout(
            group_params, bucket_size, dp_size, ddp_config, param_indices)
    return FullParamLayout(layouts=layouts)


def _compute_default_per_buffer_param_layout(params: list[torch.nn.Parameter], bucket_size: int | None,
                                             ) -> PerBufferParamLayout:
    """The layout without a distributed optimizer: no padding, params in reverse order, buckets of ``bucket_size``.

    A bucket is closed once it holds at least ``bucket_size`` elements (``None``: one bucket).
    """
    layout = PerBufferParamLayout()
    bucket_start = index = 0
    for param in params[::-1]:
        end = index + param.data.nelement()
        layout.param_index_map[param] = (index, end, len(layout.bucket_indices))
        index = end
        if bucket_size is not None and end - bucket_start >= bucket_size:
            layout.bucket_indices.append((bucket_start, end))
            layout.per_bucket_numel_unpadded.append(end - bucket_start)
            bucket_start = end
    if index > bucket_start:
        layout.bucket_indices.append((bucket_start, index))
        layout.per_bucket_numel_unpadded.append(index - bucket_start)
    return layout


class _ParamAndGradBuffer:
    """One contiguous param buffer (distributed optimizer only) and grad buffer for the params of one BufferKey.

    ``param_layout`` places the params (``DistributedOptimizer.compute_full_param_layout`` gives the padded
    layout the distributed optimizer needs); without it the unpadded default layout is used, which
    with the distributed optimizer must still split evenly across the data-parallel ranks.

    With NVFP4 parameters (``has_nvfp4_params``) the parameter buffer is placed by
    ``nvfp4_packed_param_index_map`` / ``nvfp4_packed_bucket_indices`` (``nvfp4_packed_numel`` elements) and
    the gradient buffer by ``param_index_map``; without them the packed attributes are None.
    """

    def __init__(self, ddp_config: DistributedDataParallelConfig, param_dtype: torch.dtype,
                 grad_dtype: torch.dtype, params_with_names: Sequence[tuple[torch.nn.Parameter, str]],
                 data_parallel_group: dist.ProcessGroup | None, bucket_size: int | None,
                 param_to_name: dict[torch.nn.Parameter, str], gradient_scaling_factor: float,
                 param_indices: list[int] | None = None, nccl_ub: bool = False, pg_collection: Any = None,
                 param_layout: PerBufferParamLayout | None = None, device: torch.device | None = None) -> None:
        if nccl_ub:
            raise ValueError("nccl_ub=True (NCCL user-buffer registration) is not supported by megatron_core")
        self.ddp_config = ddp_config
        self.params = [param for param, _ in params_with_names]
        if len(set(self.params)) != len(self.params):
            raise ValueError("_ParamAndGradBuffer: a parameter is listed twice")
        self.param_indices = list(param_indices) if param_indices is not None else list(range(len(self.params)))
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = get_pg_size(data_parallel_group)
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_to_name = param_to_name
        self.nccl_ub = nccl_ub

        if param_layout is None:
            param_layout = _compute_default_per_buffer_param_layout(self.params, bucket_size)
        if set(param_layout.param_index_map) != set(self.params):
            raise ValueError("_ParamAndGradBuffer: param_layout does not place exactly this buffer's parameters")
        self.param_index_map: dict[torch.nn.Parameter, tuple[int, int, int]] = param_layout.param_index_map
        self.bucket_indices: list[tuple[int, int]] = param_layout.bucket_indices
        self.per_bucket_numel_unpadded: list[int] = param_layout.per_bucket_numel_unpadded
        self.num_optimizer_shards = param_layout.num_optimizer_shards
        self.numel = self.bucket_indices[-1][1] if self.bucket_indices else 0
        self.numel_unpadded = sum(self.per_bucket_numel_unpadded)
        if ddp_config.use_distributed_optimizer and self.numel % self.data_parallel_world_size:
            raise ValueError(
                f"the buffer's {self.numel} elements do not split into {self.data_parallel_world_size} data-parallel "
                "shards: pass the layout of DistributedOptimizer.compute_full_param_layout"
            )
        self._set_nvfp4_packed_layout(param_layout)

        device = device if device is not None else get_current_device()
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_data = None
        if ddp_config.use_distributed_optimizer:
            param_numel = self.nvfp4_packed_numel if self.has_nvfp4_params else self.numel
            self.param_data = torch.zeros(param_numel, dtype=param_dtype, device=device)

        for param in self.params:
            start, end, _ = self.param_index_map[param]
            if self.param_data is not None:
                self._map_param_data(param)
            param.main_grad = self.grad_data[start:end].view(param.shape)
        # overwrite_main_grad_on_first_wgrad: reset() zeroes only the rest of grad_data, these await their GEMM.
        self.first_write_params = [p for p in self.params if ddp_config.overwrite_main_grad_on_first_wgrad
                                   and _written_only_by_wgrad_gemm(p)]
        self._zeroed_at_reset = self._complement_of(self.first_write_params)

        self.buckets: list[_ParamAndGradBucket] = []
        self.param_to_bucket: dict[torch.nn.Parameter, _ParamAndGradBucket] = {}
        bucket_params: list[list[torch.nn.Parameter]] = [[] for _ in self.bucket_indices]
        first_write = set(self.first_write_params)
        for param in self.params[::-1]:
            bucket_params[self.param_index_map[param][2]].append(param)
        for bucket_id, ((start, end), plist) in enumerate(zip(self.bucket_indices, bucket_params)):
            param_start, param_end = (self.nvfp4_packed_bucket_indices[bucket_id] if self.has_nvfp4_params
                                      else (start, end))
            bucket = _ParamAndGradBucket(
                plist,
                None if self.param_data is None else self.param_data[param_start:param_end],
                self.grad_data[start:end],
                start,
                self.per_bucket_numel_unpadded[bucket_id],
                gradient_scaling_factor,
                bucket_id,
                [p.main_grad for p in plist if p in first_write],
            )
            bucket.param_to_index = {p: (self.param_index_map[p][0] - start, self.param_index_map[p][1] - start)
                                     for p in plist}
            self.buckets.append(bucket)
            for param in plist:
                self.param_to_bucket[param] = bucket
        if logger.isEnabledFor(logging.DEBUG):  # once per pipeline stage (TP and DP x CP rank 0)
            tp, dp_cp = getattr(pg_collection, "tp", None), getattr(pg_collection, "dp_cp", None)
            groups = {"tp_group": tp, "dp_cp_group": dp_cp} if tp is not None and dp_cp is not None else {}
            log_on_each_pipeline_stage(logger, logging.DEBUG, self._bucket_summary(), **groups)

    def _set_nvfp4_packed_layout(self, param_layout: PerBufferParamLayout) -> None:
        """``has_nvfp4_params`` and, with NVFP4 parameters, the packed parameter-buffer layout (padded as the
        gradient layout is with the distributed optimizer, for this buffer's data-parallel size)."""
        nvfp4_params = [p for p in self.params if _is_nvfp4_param(p)]
        self.has_nvfp4_params = bool(nvfp4_params)
        self.nvfp4_packed_param_index_map: dict[torch.nn.Parameter, tuple[int, int, int]] | None = None
        self.nvfp4_packed_bucket_indices: list[tuple[int, int]] | None = None
        self.nvfp4_packed_numel: int | None = None
        self.nvfp4_packed_numel_unpadded: int | None = None
        if not nvfp4_params:
            return
        dp = self.data_parallel_world_size if self.ddp_config.use_distributed_optimizer else None
        packed = compute_nvfp4_packed_layout(param_layout, self.params, nvfp4_params, dp,
                                             self.ddp_config.pad_buckets_for_high_nccl_busbw)
        self.nvfp4_packed_param_index_map = packed.param_index_map
        self.nvfp4_packed_bucket_indices = packed.bucket_indices
        self.nvfp4_packed_numel = packed.bucket_indices[-1][1]
        self.nvfp4_packed_numel_unpadded = sum(packed.per_bucket_numel_unpadded)

    def _map_param_data(self, param: torch.nn.Parameter) -> None:
        """Move ``param``'s storage into its range of ``param_data``, keeping its values.

        An NVFP4 parameter moves only its packed row-wise bytes (Transformer Engine's tensor keeps its scales);
        an FP8 parameter becomes a float8 view of the ``uint8`` buffer; any other parameter a view of its range.
        """
        index_map = self.nvfp4_packed_param_index_map if self.has_nvfp4_params else self.param_index_map
        start, end, _ = index_map[param]
        modify_rowwise = (modify_nvfp4_rowwise_storage if is_nvfp4tensor(param)
                          else modify_grouped_nvfp4_rowwise_storage if is_grouped_nvfp4tensor(param) else None)
        if modify_rowwise is not None:
            shape = get_nvfp4_rowwise_packed_shape(param.data.shape)
            modify_rowwise(param, self.param_data[start:start + shape.numel()].view(shape))
            return
        view = self.param_data[start:end]
        if view.dtype != param.dtype:
            if not is_fp8_param(param):
                raise ValueError(f"parameter {self.param_to_name.get(param, '?')} of dtype {param.dtype} cannot be "
                                 f"stored in a {view.dtype} parameter buffer (only FP8 and NVFP4 parameters can)")
            view = view.view(param.dtype)  # an FP8 parameter: its float8 view of the uint8 buffer
        view = view.view(param.shape)
        view.copy_(param.data)
        param.data = view

    def _bucket_summary(self) -> str:
        """The buckets and the parameters in each, for the debug log."""
        lines = [f"{len(self.buckets)} bucket(s) of {self.param_dtype} params / {self.grad_dtype} grads:"]
        for i, bucket in enumerate(self.buckets):
            lines.append(f"bucket {i}: {self.per_bucket_numel_unpadded[i]} elements, {bucket.grad_data.numel()} "
                         "padded")
            lines += [f"\t{self.param_to_name.get(p, '?')}" for p in bucket.params_list]
        return "\n".join(lines)

    def _complement_of(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        """Views of ``grad_data`` outside ``params``' ranges (other params, alignment gaps, bucket padding).

        Adjacent ranges are merged, so the views are as few as the layout allows.
        """
        views, index = [], 0
        for start, end in sorted(self.param_index_map[p][:2] for p in params):
            if start > index:
                views.append(self.grad_data[index:start])
            index = max(index, end)
        if index < self.numel:
            views.append(self.grad_data[index:])
        return views

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every gradient in the buffer by ``scaling_factor``."""
        self.grad_data.mul_(scaling_factor)

    def reset(self) -> None:
        """Zero the gradient buffer, except the ``main_grad``s registered to be overwritten by their first GEMM."""
        if not self.ddp_config.overwrite_main_grad_on_first_wgrad:
            self.grad_data.zero_()
            return
        if self._zeroed_at_reset:
            torch._foreach_zero_(self._zeroed_at_reset)
        expect_first_write(p.main_grad for p in self.first_write_params)


def partition_buckets(buffers: Sequence[_ParamAndGradBuffer], force_single_bucket_group: bool = False,
                      ) -> list[_ParamAndGradBucketGroup]:
    """Group buckets for communication: one group per bucket, or one group for everything."""
    if not buffers:
        return []
    ddp_config = buffers[0].ddp_config
    if force_single_bucket_group:
        buckets = [b for buffer in buffers for b in buffer.buckets]
        return [_ParamAndGradBucketGroup(buckets, ddp_config, buffers[0].data_parallel_group,
                                         buffers[0].data_parallel_world_size)]
    return [
        _ParamAndGradBucketGroup([bucket], ddp_config, buffer.data_parallel_group, buffer.data_parallel_world_size)
        for buffer in buffers
        for bucket in buffer.buckets
    ]
