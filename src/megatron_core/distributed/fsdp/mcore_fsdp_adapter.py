"""``FullyShardedDataParallel``: Megatron-Core 0.19's Megatron-FSDP entry point, on this library's wrappers.

0.19 users write ``DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=...)``
and wrap each model chunk in this class. Megatron-Core runs its own sharding runtime (``MegatronFSDP``)
underneath; here each strategy is served by a wrapper the library already has, kept in ``.module``
(0.19 keeps ``MegatronFSDP`` there, so ``wrapper.module.module`` is the model in both):

- ``no_shard``: ``DistributedDataParallel``, gradients all-reduced, a plain (fp32 / mixed-precision) optimizer;
- ``optim`` (ZeRO-1): ``DistributedDataParallel`` with the distributed optimizer (gradients reduce-scattered,
  optimizer state and fp32 main weights sharded, updated weights all-gathered);
- ``optim_grads`` (ZeRO-2): the same, with the reduction overlapped with backward (0.19 turns
  ``overlap_grad_reduce`` on); the gradient buffer stays whole on every rank (only its reduced shard is read);
- ``optim_grads_params`` (ZeRO-3): ``TorchFullyShardedDataParallel`` (PyTorch FSDP2): parameters, gradients and
  optimizer state sharded, each ``fsdp_unit_modules`` module gathered around its forward and backward.

``get_megatron_optimizer`` builds the optimizer the strategy implies (:func:`megatron_fsdp_optimizer_chunks`),
whatever ``OptimizerConfig.use_distributed_optimizer`` says (0.19's training loop forces it on). Checkpoints go
through ``dist_checkpointing`` (``sharded_state_dict``) and move freely between strategies, DP sizes and the
plain wrappers; 0.19's ``fsdp_dtensor`` format is written for ``optim_grads_params`` and ``no_shard`` by
``training.save_checkpoint(..., ckpt_format="fsdp_dtensor")``. Options with no counterpart are refused by
``megatron_fsdp_options``.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size, register_wrapper
from megatron_core.device import get_current_device
from megatron_core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron_core.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from megatron_core.distributed.megatron_fsdp_options import MEGATRON_FSDP_FIELDS, check_megatron_fsdp_options
from megatron_core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron_core.distributed.torch_fully_sharded_data_parallel_config import (
    TorchFullyShardedDataParallelConfig,
)
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.tensor_parallel.random import get_cuda_rng_tracker

__all__ = ["FullyShardedDataParallel", "megatron_fsdp_optimizer_chunks"]

_DISTRIBUTED_OPTIMIZER_STRATEGIES = ("optim", "optim_grads")


def _engine_config(ddp_config: DistributedDataParallelConfig) -> DistributedDataParallelConfig:
    """The config of the wrapper that serves ``ddp_config``'s strategy (its own copy; Megatron-FSDP fields off)."""
    values = {f.name: f.default if f.name in MEGATRON_FSDP_FIELDS else getattr(ddp_config, f.name)
              for f in fields(DistributedDataParallelConfig)}
    strategy = ddp_config.data_parallel_sharding_strategy
    values["grad_reduce_in_fp32"] = (ddp_config.grad_reduce_in_fp32
                                     or ddp_config.megatron_fsdp_main_grads_dtype == torch.float32)
    if strategy == "optim_grads_params":
        values.update(use_distributed_optimizer=False, overlap_param_gather=False, align_param_gather=False)
        return TorchFullyShardedDataParallelConfig(**values, reshard_after_forward=True)
    values["use_distributed_optimizer"] = strategy in _DISTRIBUTED_OPTIMIZER_STRATEGIES
    if strategy == "no_shard":
        values.update(overlap_param_gather=False, align_param_gather=False)
    return DistributedDataParallelConfig(**values)


def _check_module(config: Any, module: torch.nn.Module) -> None:
    if getattr(config, "init_model_with_meta_device", False) or any(p.is_meta for p in module.parameters()):
        raise ValueError("FullyShardedDataParallel needs materialised parameters (init_model_with_meta_device="
                         f"{getattr(config, 'init_model_with_meta_device', False)}, or parameters on the meta "
                         "device): every rank builds the full weights from the same seed and keeps its shard")


@register_wrapper
class FullyShardedDataParallel(torch.nn.Module):
    """Megatron-FSDP's wrapper (0.19 signature) over the library's DDP / FSDP2 wrappers (see the module docstring).

    ``fsdp_unit_modules``: module classes gathered as one unit under ``optim_grads_params`` (default: the
    registered units, ``TransformerLayer`` and ``LanguageModelEmbedding``); unused by the other strategies, as
    in 0.19. ``device``: where the module is moved first (default: the current device). ``disable_bucketing``
    puts every parameter into one bucket. Like 0.19, the constructor turns ``ddp_config.overlap_grad_reduce`` on
    for ``optim_grads`` / ``optim_grads_params`` and ``overlap_param_gather`` for ``optim_grads_params``, and copies
    tensor-parallel rank 0's random states to the other TP ranks.
    """

    def __init__(self, config: Any, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 fsdp_unit_modules: list[type] | None = None, disable_bucketing: bool = False,
                 device: torch.device | None = None, pg_collection: Any = None) -> None:
        super().__init__()
        check_megatron_fsdp_options(ddp_config)
        _check_module(config, module)
        self.config = config
        self.ddp_config = ddp_config
        self.data_parallel_sharding_strategy = ddp_config.data_parallel_sharding_strategy
        self.device = torch.device(device) if device is not None else get_current_device()
        module.to(self.device)
        if self.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params"):
            ddp_config.overlap_grad_reduce = True
        if self.data_parallel_sharding_strategy == "optim_grads_params":
            ddp_config.overlap_param_gather = True
        self.engine_ddp_config = _engine_config(ddp_config)
        self.fsdp_unit_modules = list(fsdp_unit_modules) if fsdp_unit_modules is not None else None
        kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
        if self.data_parallel_sharding_strategy == "optim_grads_params":
            self.module: torch.nn.Module = TorchFullyShardedDataParallel(
                config, self.engine_ddp_config, module, sub_modules_to_wrap=self.fsdp_unit_modules,
                disable_bucketing=disable_bucketing, **kwargs)
        else:
            self.module = DistributedDataParallel(config, self.engine_ddp_config, module,
                                                  disable_bucketing=disable_bucketing, **kwargs)
        self.tp_group = resolve_process_group("tp", pg_collection)
        self.sync_rng_states_across_tp_group()

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Call the wrapped model."""
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all but the last microbatch)."""
        with self.module.no_sync():
            yield

    def start_grad_sync(self, *unused: Any) -> None:
        """Launch the gradient reduction (a no-op where it already runs during backward)."""
        self.module.start_grad_sync(*unused)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Wait for (or run) the gradient reduction; call before the optimizer step."""
        self.module.finish_grad_sync(force_all_reduce=force_all_reduce)

    def start_param_sync(self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False) -> None:
        """All-gather the updated weight shards (``optim`` / ``optim_grads``; nothing to do otherwise)."""
        self.module.start_param_sync(*unused, force_sync=force_sync, force_dispatch=force_dispatch)

    def synchronize_param_gather(self) -> None:
        """Wait until every dispatched parameter all-gather is done."""
        if isinstance(self.module, DistributedDataParallel) and self.engine_ddp_config.use_distributed_optimizer:
            for group in self.module.bucket_groups + self.module.expert_parallel_bucket_groups:
                if group.param_gather_dispatched:
                    group.finish_param_sync(skip_next_bucket_dispatch=True)

    def stop_communication(self) -> None:
        """Wait for every parameter gather and gradient reduction in flight (FSDP2's finish within backward)."""
        self.synchronize_param_gather()
        if isinstance(self.module, DistributedDataParallel):
            for group in self.module.bucket_groups + self.module.expert_parallel_bucket_groups:
                if group.grad_reduce_handles is not None:
                    group.finish_grad_sync()

    def scale_gradients(self, scaling_factor: float) -> None:
        """Multiply every (reduced) gradient by ``scaling_factor``."""
        self.module.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Zero the gradients; call at the start of each iteration, with ``optimizer.zero_grad()``."""
        self.module.zero_grad_buffer()

    def broadcast_params(self) -> None:
        """Make every data-parallel rank's weights data-parallel rank 0's (a no-op for sharded weights)."""
        self.module.broadcast_params()

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's state dict, under the model's own keys (DTensor values under ``optim_grads_params``)."""
        return self.module.state_dict(*args, **kwargs)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False) -> dict[str, Any]:
        """The same as :meth:`state_dict` (0.19 aliases them)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True) -> Any:
        """Load a state dict with the model's own keys (full tensors, or this rank's rows when sharded)."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def sharded_state_dict(self, prefix: str = "", *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's sharded state dict for ``dist_checkpointing`` (sharded rows under ``optim_grads_params``)."""
        return self.module.sharded_state_dict(prefix, *args, **kwargs)

    def sync_rng_states_across_tp_group(self) -> None:
        """Give every tensor-parallel rank TP rank 0's Python, NumPy, torch, CUDA and tracker random states."""
        if get_pg_size(self.tp_group) <= 1:
            return
        states = [_rng_states()] if get_pg_rank(self.tp_group) == 0 else [None]
        dist.broadcast_object_list(states, src=dist.get_global_rank(self.tp_group, 0), group=self.tp_group)
        _set_rng_states(states[0])


def _rng_states() -> dict[str, Any]:
    tracker = {name: state.get_state() if isinstance(state, torch.Generator) else state
               for name, state in get_cuda_rng_tracker().get_states().items()}
    return {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None, "tracker": tracker}


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["random"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    if states["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    get_cuda_rng_tracker().set_states(states["tracker"])


def megatron_fsdp_optimizer_chunks(model_chunks: list[torch.nn.Module], config: Any) -> tuple[list[Any], Any]:
    """``(chunks, config)`` for the optimizer factory: :class:`FullyShardedDataParallel` chunks replaced by the
    wrappers serving them and ``config.use_distributed_optimizer`` set as their strategy implies (a copy).

    Other chunks come back unchanged with ``config``; mixing strategies, or adapter and plain chunks, raises.
    """
    adapters = [chunk for chunk in model_chunks if isinstance(chunk, FullyShardedDataParallel)]
    if not adapters:
        return model_chunks, config
    strategies = {chunk.data_parallel_sharding_strategy for chunk in adapters}
    if len(adapters) != len(model_chunks) or len(strategies) > 1:
        raise ValueError("get_megatron_optimizer needs every model chunk wrapped in FullyShardedDataParallel with "
                         f"one data_parallel_sharding_strategy (got {sorted(strategies)} over {len(adapters)} of "
                         f"{len(model_chunks)} chunks)")
    config = copy.copy(config)  # not dataclasses.replace: the copy is not re-validated
    config.use_distributed_optimizer = strategies.pop() in _DISTRIBUTED_OPTIMIZER_STRATEGIES
    return [chunk.module for chunk in adapters], config
