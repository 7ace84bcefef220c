"""``DistributedOptimizer``: ZeRO-1 sharding of main params and optimizer state over data parallel ranks.

Megatron-Core's distributed optimizer. Each DDP bucket is split into ``dp`` equal contiguous
shards (see :mod:`megatron_core.distributed.param_and_grad_buffer`); rank ``r`` owns shard ``r``
of every bucket. For each param that overlaps the owned shard, this rank keeps an fp32 main
param for just that slice (a view of the param buffer itself when params are fp32) and the inner
optimizer's state for it. A step reads the reduce-scattered gradient slice from ``main_grad``,
updates the slice, writes it into the param buffer and all-gathers the buffer (or lets the DDP
forward pre-hooks do it with ``overlap_param_gather``).

With ``use_precision_aware_optimizer`` the main params are kept in ``main_params_dtype`` (a view of
the param buffer when that is the params' dtype) and the inner optimizer is
:class:`~megatron_core.optimizer.precision_aware_adam.PrecisionAwareAdam` (moments in
``exp_avg_dtype``/``exp_avg_sq_dtype``). With ``optimizer_cpu_offload`` the main params (and so the
optimizer state) of the first ``optimizer_offload_fraction`` of the shard's elements live on the
CPU: gradients are copied there, the step runs there, and the results are copied back.

FP8 parameters (``fp8_param``, :mod:`megatron_core.distributed.fp8_params`) get fp32 main weights from their
high-precision initial values; after each step every rank quantizes its main shards into their bytes
with per-parameter scales agreed over the DP group (``quantize_param_shard``: one per tensorwise parameter,
one per row of a row-wise one such as the MoE experts', all in one all-reduce), and the all-gather moves
the 1-byte buffer.

``state_dict`` holds this rank's shard state plus metadata (param names, shapes, flat ranges, DP
rank and size) so a checkpointing layer can reshard it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.device import cuda_available
from megatron_core.dist_checkpointing.optimizer import dp_flat_shard_to_full, full_to_dp_flat_shard
from megatron_core.distributed import collectives
from megatron_core.distributed.fp8_params import (
    FP8_PARAM_BUFFER_DTYPE,
    clear_high_precision_init_val,
    is_fp8_param,
    main_param_shard,
    quantize_param_shard,
)
from megatron_core.distributed.param_and_grad_buffer import compute_full_param_layout
from megatron_core.distributed.param_layout import compute_per_buffer_param_layout
from megatron_core.optimizer.checkpoint_state import (
    ParamStateEntry,
    is_model_space_state,
    load_model_space_state,
)
from megatron_core.optimizer.clip_grads import counts_towards_grad_norm
from megatron_core.optimizer.flat_adam import FlatAdamShards, FlatShard
from megatron_core.optimizer.grad_norm_groups import in_grad_norm
from megatron_core.optimizer.grad_scaler import MegatronGradScaler
from megatron_core.optimizer.optimizer import MixedPrecisionOptimizer, copy_param_attributes
from megatron_core.optimizer.optimizer_config import OptimizerConfig
from megatron_core.optimizer.precision_aware_adam import PrecisionAwareAdam
from megatron_core.process_groups_config import resolve_process_group


@dataclass(frozen=True)
class Range:
    """A half-open index range ``[start, end)``."""

    start: int
    end: int

    @property
    def size(self) -> int:
        """Number of elements."""
        return self.end - self.start

    def normalize(self, start: int = 0) -> Range:
        """The same size, shifted to begin at ``start``."""
        return Range(start, start + self.size)


@dataclass
class _ShardEntry:
    """One model param's slice owned by this rank."""

    model_param: torch.nn.Parameter
    main_param: torch.Tensor
    param_range: Range  # in the flattened param
    gbuf_world_range: Range  # in the buffer
    name: str
    chunk_index: int
    offloaded: bool = False  # main param and optimizer state live on the CPU (optimizer_cpu_offload)
    grad_view: torch.Tensor | None = None  # this slice of ``model_param.main_grad`` (made once, reused every step)
    grad_view_of: torch.Tensor | None = None  # the ``main_grad`` it views


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Shard fp32 main params and optimizer state over the data parallel group (ZeRO-1).

    With Adam on CUDA (precision-aware or not; nothing offloaded) the shards' main params and moments
    are flat buffers stepped by one fused kernel per bucket shard that also writes the model params
    (:mod:`~megatron_core.optimizer.flat_adam`; FP8 parameters are quantized from their main shards after
    it); ``flat_shard_step`` = True / False forces it on (CPU included) or off. Set it before
    ``get_megatron_optimizer``, which picks the optimizer class by it.

    ``model_chunks`` are the DDP-wrapped chunks built with ``use_distributed_optimizer=True``;
    ``per_model_buffers`` maps chunk index to the DDP buffers this optimizer covers (dense or
    expert). ``optimizer`` is built on the model params and is re-pointed at the shards here.
    """

    # The layout rules live with the buffers they place (distributed.param_layout / param_and_grad_buffer).
    _compute_per_buffer_param_layout = staticmethod(compute_per_buffer_param_layout)
    compute_full_param_layout = staticmethod(compute_full_param_layout)

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: MegatronGradScaler | None, init_state_fn: Callable[[torch.optim.Optimizer], None],
                 model_chunks: list[torch.nn.Module], per_model_buffers: dict[int, list[Any]],
                 data_parallel_group: dist.ProcessGroup | None,
                 data_parallel_group_gloo: dist.ProcessGroup | None = None,
                 data_parallel_group_idx: int = 0, distributed_optimizer_instance_id: int = 0) -> None:
        super().__init__(optimizer, config, grad_scaler, init_state_fn)
        for chunk in model_chunks:
            if not getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False):
                raise ValueError("DistributedOptimizer needs model chunks wrapped in DistributedDataParallel "
                                 "with use_distributed_optimizer=True")
        if any(buffer.has_nvfp4_params for buffers in per_model_buffers.values() for buffer in buffers):
            raise ValueError("DistributedOptimizer: the DDP buffers hold Transformer Engine NVFP4 parameters, whose "
                             "main-weight shards this optimizer does not quantize (Megatron-Core uses Transformer "
                             "Engine's quantize_master_weights); use high-precision or fp8_param parameters")
        self.model_chunks = model_chunks
        self.per_model_buffers = per_model_buffers
        self.data_parallel_group = data_parallel_group = collectives.local_if_none(data_parallel_group)
        # Which replica this is under num_distributed_optimizer_instances (each instance holds the whole state).
        self.data_parallel_group_idx = data_parallel_group_idx
        self.distributed_optimizer_instance_id = distributed_optimizer_instance_id
        self.data_parallel_group_gloo = data_parallel_group_gloo
        self.data_parallel_rank = get_pg_rank(data_parallel_group)
        self.data_parallel_world_size = get_pg_size(data_parallel_group)
        # Each rank holds DP shards of its model-parallel shards: statistics sum over DP, then over MP.
        self.grad_stats_parallel_group = collectives.GroupProduct(
            data_parallel_group, collectives.local_if_none(resolve_process_group("mp")))
        # Asked here, on every rank and over the model params, so that later questions (the flat step's choice
        # below, clipping) are answered from the cache without a collective that some ranks would skip.
        separate_norm_groups = self._has_separate_grad_norm_groups()

        self.main_params_dtype = config.main_params_dtype if config.use_precision_aware_optimizer else torch.float32
        # FP8 parameters (fp8_param), in the same order on every DP rank: quantized from the main shards each step.
        self.fp8_params = [p for buffers in per_model_buffers.values() for buffer in buffers for p in buffer.params
                           if is_fp8_param(p)]
        owned, fp8_bucket_mains = self._build_shard_entries()
        clear_high_precision_init_val(self.fp8_params)
        self._offload_entries(owned)
        flat_shards = self._flatten_shards(owned, fp8_bucket_mains) if self._uses_flat_step(owned) else None
        self.bucket_groups = self._own_bucket_groups()
        self.shard_groups: list[list[_ShardEntry]] = []
        for group in self.optimizer.param_groups:
            entries = [owned[p] for p in group["params"] if p in owned]
            self.shard_groups.append(entries)
            group["params"] = [e.main_param for e in entries]
        self.optimizer.state.clear()
        self._flat = FlatAdamShards(self.optimizer, flat_shards) if flat_shards else None
        # When every owned piece counts towards the norm, the norm reads each flat shard's gradient slice
        # whole (one tensor per bucket; DDP's padding between params holds zeros).
        tp_rank = get_pg_rank(self.tp_group)
        self._norm_over_flat_shards = self._flat is not None and not separate_norm_groups and all(
            counts_towards_grad_norm(p, tp_rank) for p in self.get_parameters())
        # Under the flat step nothing else may need the main params' gradients: the step reads the gradient
        # buffers, and the norm their flat slices or the counted pieces' buffer views. Copies in another dtype
        # (bf16 buffers, fp32 main params) would then be a pass over every gradient for nothing (6 bytes an
        # element; 10 ms of a 3B model's step on an H200). The zero count still reads them.
        self._skip_main_grad_copies = (self._flat is not None and self._main_grads_are_copies()
                                       and not self.config.log_num_zeros_in_grad)

    flat_shard_step: bool | None = None  # None: on CUDA when eligible; True / False: force on / off

    @classmethod
    def flat_step_on(cls, device: torch.device) -> bool:
        """Whether the flat fused step is wanted for state on ``device``: ``flat_shard_step`` if set, else CUDA."""
        return device.type == "cuda" if cls.flat_shard_step is None else cls.flat_shard_step

    def _uses_flat_step(self, owned: dict[torch.nn.Parameter, _ShardEntry]) -> bool:
        """The flat fused step serves the precision-aware Adam when no shard is offloaded."""
        if not owned or not isinstance(self.optimizer, PrecisionAwareAdam) or any(e.offloaded for e in owned.values()):
            return False
        if len({(tuple(g["betas"]), g["eps"]) for g in self.optimizer.param_groups}) > 1:
            return False  # per-group betas / eps (e.g. muP's eps): the per-parameter step
        if self._main_grads_are_copies() and self._main_grads_rewritten_before_step():
            # The flat step reads the gradient buffers, which unscaling or clipping the copies would not change.
            return False
        return self.flat_step_on(next(iter(owned.values())).main_param.device)

    def _main_grads_are_copies(self) -> bool:
        """Whether the main params' gradients are copies (a gradient buffer's dtype differs from the main params')
        rather than views of the gradient buffers."""
        return any(buffer.grad_data.dtype != self.main_params_dtype
                   for buffers in self.per_model_buffers.values() for buffer in buffers)

    def _flatten_shards(self, owned: dict[torch.nn.Parameter, _ShardEntry],
                        fp8_bucket_mains: dict[int, torch.Tensor]) -> list[FlatShard]:
        """One flat shard per owned bucket slice; each entry's main param becomes a view of its shard (an FP8
        bucket's shard is the main-weight buffer ``fp8_bucket_mains`` holds for it, by bucket id)."""
        shards = []
        for buffers in self.per_model_buffers.values():
            for buffer in buffers:
                for bucket in buffer.buckets:
                    entries = [owned[p] for p in bucket.params_list if p in owned]
                    if not entries:
                        continue
                    shard_size = bucket.grad_data.numel() // self.data_parallel_world_size
                    start = bucket.offset + self.data_parallel_rank * shard_size
                    params = buffer.param_data[start:start + shard_size]
                    if params.dtype == FP8_PARAM_BUFFER_DTYPE:  # FP8 parameters: quantized after the step
                        main, model_out = fp8_bucket_mains[id(bucket)], None
                    elif params.dtype == self.main_params_dtype:
                        main, model_out = params, None
                    else:
                        main, model_out = params.to(self.main_params_dtype), params
                    shard = FlatAdamShards.make_shard(main, buffer.grad_data[start:start + shard_size], model_out,
                                                      self.optimizer.exp_avg_dtype, self.optimizer.exp_avg_sq_dtype)
                    for entry in entries:
                        lo, hi = entry.gbuf_world_range.start - start, entry.gbuf_world_range.end - start
                        view = main[lo:hi]
                        copy_param_attributes(view, entry.model_param)
                        entry.main_param = view
                        shard.pieces.append((view, lo, hi))
                    shards.append(shard)
        return shards

    def _build_shard_entries(self) -> tuple[dict[torch.nn.Parameter, _ShardEntry], dict[int, torch.Tensor]]:
        """This rank's shard entries by param, and the FP8 parameters' fp32 main-weight buffers by bucket id: one
        zero-padded buffer per bucket shard, each entry a view of it, so the flat step uses it as is (a per-entry
        copy first would hold the shard's main weights twice)."""
        owned: dict[torch.nn.Parameter, _ShardEntry] = {}
        fp8_bucket_mains: dict[int, torch.Tensor] = {}
        for chunk_index, buffers in self.per_model_buffers.items():
            for buffer in buffers:
                if buffer.data_parallel_world_size != self.data_parallel_world_size:
                    raise ValueError(
                        f"DDP buffer is sharded over {buffer.data_parallel_world_size} ranks but the optimizer's "
                        f"data parallel group has {self.data_parallel_world_size}"
                    )
                for bucket in buffer.buckets:
                    shard_size = bucket.grad_data.numel() // self.data_parallel_world_size
                    shard = Range(bucket.offset + self.data_parallel_rank * shard_size,
                                  bucket.offset + (self.data_parallel_rank + 1) * shard_size)
                    for param in bucket.params_list:
                        start, end, _ = buffer.param_index_map[param]
                        lo, hi = max(start, shard.start), min(end, shard.end)
                        if lo >= hi:
                            continue
                        param_range = Range(lo - start, hi - start)
                        flat = param.detach().view(-1)[param_range.start:param_range.end]
                        dtype = self.main_params_dtype
                        if is_fp8_param(param):
                            if id(bucket) not in fp8_bucket_mains:
                                fp8_bucket_mains[id(bucket)] = torch.zeros(shard_size, dtype=dtype,
                                                                           device=param.device)
                            main = fp8_bucket_mains[id(bucket)][lo - shard.start:hi - shard.start]
                            main.copy_(main_param_shard(param, param_range.start, param_range.end, dtype))
                        else:
                            main = flat if param.dtype == dtype else flat.clone().to(dtype)
                        copy_param_attributes(main, param)
                        owned[param] = _ShardEntry(param, main, param_range, Range(lo, hi),
                                                   buffer.param_to_name.get(param, ""), chunk_index)
        return owned, fp8_bucket_mains

    def _offload_entries(self, owned: dict[torch.nn.Parameter, _ShardEntry]) -> None:
        """Move the main params of the first ``optimizer_offload_fraction`` of this rank's elements to the CPU.

        Their optimizer state is then created on the CPU by the first step; gradients go to the CPU
        and updated values come back every step (Megatron-Core's ``optimizer_cpu_offload``).
        """
        if not self.config.optimizer_cpu_offload or self.config.optimizer_offload_fraction <= 0.0:
            return
        entries = list(owned.values())
        budget = self.config.optimizer_offload_fraction * sum(e.main_param.numel() for e in entries)
        moved = 0
        pin = cuda_available() and bool(entries) and entries[0].main_param.device.type == "cuda"
        for entry in entries:
            if moved >= budget:
                break
            cpu = torch.empty(entry.main_param.shape, dtype=self.main_params_dtype, device="cpu", pin_memory=bool(pin))
            cpu.copy_(entry.main_param.detach())
            copy_param_attributes(cpu, entry.model_param)
            entry.main_param = cpu
            entry.offloaded = True
            moved += cpu.numel()

    def _own_bucket_groups(self) -> list[Any]:
        """The DDP bucket groups over this optimizer's buffers (a dense and an expert optimizer split them)."""
        buckets = {id(b) for buffers in self.per_model_buffers.values() for buffer in buffers for b in buffer.buckets}
        groups = []
        for chunk in self.model_chunks:
            for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
                if any(id(b) in buckets for b in group.buckets):
                    groups.append(group)
        return groups

    def _entries(self) -> list[_ShardEntry]:
        return [e for group in self.shard_groups for e in group]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shard gradients and any model ``.grad`` (DDP's ``zero_grad_buffer`` zeroes main_grad)."""
        for entry in self._entries():
            entry.main_param.grad = None
            entry.model_param.grad = None

    def _collect_main_grad_data_for_unscaling(self) -> list[torch.Tensor]:
        return [e.main_param.grad for e in self._entries() if e.main_param.grad is not None]

    def get_grads_for_grad_norm(self, grad_norm_group: str | None = None) -> list[torch.Tensor]:
        """The owned gradients of the main norm (whole flat shard slices where every piece counts) or of the named
        group."""
        if grad_norm_group is None and self._norm_over_flat_shards:
            return [shard.grad for shard in self._flat.shards]
        if self._skip_main_grad_copies:  # the counted pieces, read in the gradient buffers
            tp_rank = get_pg_rank(self.tp_group)
            return [self._grad_view(e) for e in self._entries()
                    if counts_towards_grad_norm(e.main_param, tp_rank) and in_grad_norm(e.main_param, grad_norm_group)]
        return super().get_grads_for_grad_norm(grad_norm_group)

    @staticmethod
    def _grad_view(entry: _ShardEntry) -> torch.Tensor:
        """``entry``'s slice of its model param's ``main_grad`` (made again only when the buffer changed)."""
        main_grad = entry.model_param.main_grad
        if entry.grad_view_of is not main_grad:
            entry.grad_view = main_grad.view(-1)[entry.param_range.start:entry.param_range.end]
            entry.grad_view_of = main_grad
        return entry.grad_view

    def _copy_model_grads_to_main_grads(self) -> None:
        if self._skip_main_grad_copies:
            return
        for entry in self._entries():
            flat, main = self._grad_view(entry), entry.main_param
            same = flat.dtype == main.dtype and flat.device == main.device
            main.grad = flat if same else flat.to(device=main.device, dtype=main.dtype)

    def _copy_main_params_to_model_params(self) -> None:
        for entry in self._entries():
            if is_fp8_param(entry.model_param):
                continue
            flat = entry.model_param.detach().view(-1)[entry.param_range.start:entry.param_range.end]
            if entry.main_param.data_ptr() != flat.data_ptr():
                flat.copy_(entry.main_param, non_blocking=entry.offloaded)
        if self.fp8_params:
            self._quantize_fp8_params()

    def _quantize_fp8_params(self) -> None:
        """Quantize the owned main shards into the FP8 parameters, with scales agreed over the DP group."""
        owned = {id(e.model_param): e for e in self._entries()}
        entries = [owned.get(id(p)) for p in self.fp8_params]
        quantize_param_shard(self.fp8_params, [None if e is None else e.main_param for e in entries],
                             [0 if e is None else e.param_range.start for e in entries], self.data_parallel_group)

    def step_with_ready_grads(self) -> bool:
        """Update the owned shards, write them into the param buffers and all-gather (or dispatch)."""
        if self._flat is not None:  # one kernel per shard, the model params written by it (FP8 ones quantized after)
            self._flat.step(getattr(self.optimizer, "grad_scale", None), getattr(self.optimizer, "found_inf", None))
            if self.fp8_params:
                self._quantize_fp8_params()
        else:
            self.optimizer.step()
            self._copy_main_params_to_model_params()
        for group in self.bucket_groups:
            if not group.ddp_config.overlap_param_gather:
                group.start_param_sync()
            elif self.config.overlap_param_gather_with_optimizer_step and not group.param_gather_dispatched:
                group.start_param_sync()
        return True

    def _step_takes_clip_factor(self) -> bool:
        # The flat step divides by the clip factor and skips on a non-finite norm, as torch's fused Adam.
        return self._flat is not None or super()._step_takes_clip_factor()

    def reload_model_params(self) -> None:
        """Refresh the fp32 shard main params from the model params."""
        for entry in self._entries():
            if is_fp8_param(entry.model_param):
                entry.main_param.data.copy_(main_param_shard(entry.model_param, entry.param_range.start,
                                                             entry.param_range.end, entry.main_param.dtype))
                continue
            flat = entry.model_param.detach().view(-1)[entry.param_range.start:entry.param_range.end]
            if entry.main_param.data_ptr() != flat.data_ptr():
                entry.main_param.data.copy_(flat)

    def shard_metadata(self) -> dict[str, Any]:
        """Which slice of which param each optimizer tensor holds, to reshard a checkpoint."""
        return {
            "data_parallel_rank": self.data_parallel_rank,
            "data_parallel_world_size": self.data_parallel_world_size,
            "params": [
                [{"name": e.name, "model_chunk": e.chunk_index, "global_shape": tuple(e.model_param.shape),
                  "param_range": (e.param_range.start, e.param_range.end),
                  "gbuf_world_range": (e.gbuf_world_range.start, e.gbuf_world_range.end)}
                 for e in group]
                for group in self.shard_groups
            ],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard: inner optimizer state, fp32 main param slices, scaler and shard metadata."""
        state = {
            "optimizer": self.optimizer.state_dict(),
            "fp32_main_params": [[e.main_param.detach().clone() for e in group] for group in self.shard_groups],
            "shard_metadata": self.shard_metadata(),
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False,
                           sharding_type: str | None = None, metadata: dict | None = None,
                           state_names: list[str] | None = None) -> dict[str, Any]:
        """Model-space sharded state (Megatron-Core's ``fully_reshardable``; the only ``sharding_type``).

        Each state is assembled from the DP ranks' flat slices into whole TP-local tensors (an
        all-reduce over the DP group per parameter and state), so it reshards over DP as well.
        """
        if sharding_type not in (None, "fully_reshardable"):
            raise ValueError(f"DistributedOptimizer.sharded_state_dict: sharding_type={sharding_type!r} is not "
                             "supported; only 'fully_reshardable' (the default) is")
        return super().sharded_state_dict(model_sharded_state_dict, is_loading, metadata, state_names)

    def _checkpoint_entries(self, model_params: list[torch.Tensor]) -> list[ParamStateEntry]:
        """Every trainable parameter of this optimizer's DDP buffers, with this rank's slice (``main=None`` where it
        owns none): the assembly is collective, so every DP rank lists the same parameters. (A chained dense and
        expert optimizer pair thus write disjoint keys.)"""
        owned = {id(e.model_param): e for e in self._entries()}
        mine = {id(p) for buffers in self.per_model_buffers.values() for buffer in buffers for p in buffer.params}
        out = []
        for p in model_params:
            if not p.requires_grad or id(p) not in mine:
                continue
            e = owned.get(id(p))
            out.append(ParamStateEntry(p, None) if e is None else
                       ParamStateEntry(p, e.main_param, (e.param_range.start, e.param_range.end)))
        return out

    def _checkpoint_full(self, entry: ParamStateEntry, value: torch.Tensor | None) -> torch.Tensor:
        if value is None:
            value = torch.zeros(0, dtype=torch.float32, device=entry.model_param.device)
        # Offloaded (CPU) shards join the all-reduce on the model's device.
        return dp_flat_shard_to_full(value.detach().float().to(entry.model_param.device), entry.param_range or (0, 0),
                                     entry.model_param.shape, self.data_parallel_group)

    def _checkpoint_local(self, entry: ParamStateEntry, full: torch.Tensor) -> torch.Tensor:
        return full_to_dp_flat_shard(full, entry.param_range)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore this rank's shard; the layout must match (a loaded :meth:`sharded_state_dict` reshards)."""
        if self._flat is not None:
            self._flat.bound = False  # the loaded state replaces the flat views; the next step copies it back in
        if is_model_space_state(state_dict):
            load_model_space_state(self, state_dict["optimizer"])
            if self.fp8_params:  # the FP8 bytes and scales exactly as the loaded main weights give them
                self._copy_main_params_to_model_params()
                for group in self.bucket_groups:
                    group.start_param_sync(force_sync=True)
            return
        saved, current = state_dict["shard_metadata"], self.shard_metadata()
        if saved != current:
            raise ValueError(
                f"distributed optimizer shard layout differs from the checkpoint (saved DP rank "
                f"{saved['data_parallel_rank']} of {saved['data_parallel_world_size']}, now "
                f"{current['data_parallel_rank']} of {current['data_parallel_world_size']}); load it through "
                "dist_checkpointing to reshard"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        for group, values in zip(self.shard_groups, state_dict["fp32_main_params"]):
            for entry, value in zip(group, values):
                entry.main_param.data.copy_(value)
        self._copy_main_params_to_model_params()
        for group in self.bucket_groups:
            group.start_param_sync(force_sync=True)
