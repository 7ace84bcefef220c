"""Build a rank's model chunks and wire the schedule hooks (Megatron-LM's ``get_model`` and ``train`` set-up).

:func:`get_model` calls a user's ``model_provider_func`` once per virtual pipeline stage this rank
holds, with the stage's ``pre_process``/``post_process`` flags, moves each chunk to this rank's
device, wraps it in ``Float16Module`` when the model's config asks for fp16/bf16, and (by default)
in :class:`~megatron_core.distributed.DistributedDataParallel`. :func:`configure_model_hooks` then
sets the ``config`` hooks the schedules and the training step read (``no_sync_func``,
``grad_sync_func``, ``param_sync_func``, ``grad_scale_func``, ``finalize_model_grads_func``)::

    def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        return GPTModel(config, get_gpt_layer_local_spec(), vocab_size, max_seq, pre_process=pre_process,
                        post_process=post_process, vp_stage=vp_stage)

    model = get_model(partial(model_provider, config=config), ddp_config=DistributedDataParallelConfig())
    optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3), model)
    configure_model_hooks(config, model, optimizer)

Megatron-LM keeps ``get_model`` in ``megatron.training.training``, reading its global ``args``;
here the same logic lives in the training-loop layer with explicit arguments, and
``megatron_core.training.model_builder`` re-exports it (see ``docs/compat.md``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from megatron_core import device
from megatron_core._ground import get_pg_size
from megatron_core._wrapped_model import get_model_config
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.pipeline_parallel.utils import (
    is_pp_first_stage,
    is_pp_last_stage,
    is_vp_first_stage,
    is_vp_last_stage,
)
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.module import Float16Module

__all__ = ["configure_model_hooks", "get_model"]


def _build_chunks(model_provider_func: Callable[..., torch.nn.Module], model_type: ModelType, config: Any,
                  pg_collection: Any, vp_size: int | None) -> list[torch.nn.Module]:
    """One model per virtual stage (or one model), each told whether it holds the first/last layers."""
    pp_group = pg_collection.pp
    kwargs: dict[str, Any] = {"config": config, "pg_collection": pg_collection}
    if get_pg_size(pp_group) > 1 and vp_size is not None and vp_size > 1:
        chunks = []
        for stage in range(vp_size):
            chunk = model_provider_func(
                pre_process=is_pp_first_stage(pp_group) and is_vp_first_stage(stage, vp_size),
                post_process=is_pp_last_stage(pp_group) and is_vp_last_stage(stage, vp_size),
                vp_stage=stage, **kwargs,
            )
            chunk.model_type = model_type
            chunk.vp_stage = stage
            chunks.append(chunk)
        return chunks
    chunk = model_provider_func(pre_process=is_pp_first_stage(pp_group), post_process=is_pp_last_stage(pp_group),
                                **kwargs)
    chunks = chunk if isinstance(chunk, list) else [chunk]
    for chunk in chunks:
        chunk.model_type = model_type
    return chunks


def get_model(model_provider_func: Callable[..., torch.nn.Module],
              model_type: ModelType = ModelType.encoder_or_decoder, wrap_with_ddp: bool = True, *,
              config: Any = None, pg_collection: Any = None,
              ddp_config: DistributedDataParallelConfig | None = None,
              virtual_pipeline_model_parallel_size: int | None = None,
              data_parallel_random_init: bool = False, use_torch_fsdp2: bool = False) -> list[torch.nn.Module]:
    """This rank's model chunks: built, on this rank's device, fp16/bf16-wrapped and DDP-wrapped.

    ``model_provider_func(pre_process=, post_process=, [vp_stage=,] config=, pg_collection=)``
    returns one model (or chunk); ``vp_stage`` is passed only under a virtual pipeline, whose size is
    ``virtual_pipeline_model_parallel_size`` (default: ``config.virtual_pipeline_model_parallel_size``)
    and which needs a pipeline group of more than one rank. The pipeline group comes from
    ``pg_collection`` (else ``parallel_state``). Each chunk is wrapped in ``Float16Module`` when its
    config has ``fp16`` or ``bf16``, then (``wrap_with_ddp``) in ``DistributedDataParallel`` with
    ``ddp_config`` (default ``DistributedDataParallelConfig()``), bucketing disabled on every chunk
    but the first (Megatron-FSDP's ``FullyShardedDataParallel`` when ``ddp_config.use_megatron_fsdp``, as Megatron-LM's
    ``--use-megatron-fsdp``). ``data_parallel_random_init`` broadcasts data-parallel rank 0's weights after
    wrapping. With ``use_torch_fsdp2`` (Megatron-LM's ``--use-torch-fsdp2``) each chunk is wrapped in
    :class:`~megatron_core.distributed.TorchFullyShardedDataParallel` instead, without ``Float16Module``
    (FSDP2 keeps fp32 shards and computes in bf16 through its mixed-precision policy); ``ddp_config`` is
    then read as a ``TorchFullyShardedDataParallelConfig``. Returns a list with one module per virtual stage.
    """
    pgs = resolve_pg_collection(pg_collection)
    vp_size = virtual_pipeline_model_parallel_size
    if vp_size is None and config is not None:
        vp_size = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if vp_size is not None and vp_size < 1:
        raise ValueError(f"virtual_pipeline_model_parallel_size must be >= 1 or None, got {vp_size}")
    if data_parallel_random_init and not wrap_with_ddp:
        raise ValueError("data_parallel_random_init=True needs wrap_with_ddp=True (DDP broadcasts the weights)")

    model = _build_chunks(model_provider_func, model_type, config, pgs, vp_size)
    for chunk in model:
        for param in chunk.parameters():
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    target = device.get_current_device()
    model = [chunk.to(target) for chunk in model]

    model_config = get_model_config(model[0])
    if use_torch_fsdp2 and ddp_config is not None and ddp_config.use_megatron_fsdp:
        raise ValueError("use_torch_fsdp2=True and ddp_config.use_megatron_fsdp=True exclude each other: pick one FSDP")
    if use_torch_fsdp2:
        if not wrap_with_ddp or data_parallel_random_init:
            raise ValueError("use_torch_fsdp2=True needs wrap_with_ddp=True and data_parallel_random_init=False "
                             "(FSDP2 shards the weights every rank built from the same seed)")
        return [_fsdp2_chunk(model_config, chunk, ddp_config, pg_collection) for chunk in model]
    if getattr(model_config, "fp16", False) or getattr(model_config, "bf16", False):
        model = [Float16Module(model_config, chunk) for chunk in model]
    if not wrap_with_ddp:
        return model

    ddp_config = ddp_config if ddp_config is not None else DistributedDataParallelConfig()
    ddp_kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    wrapper = FullyShardedDataParallel if ddp_config.use_megatron_fsdp else DistributedDataParallel
    model = [wrapper(model_config, ddp_config, chunk, disable_bucketing=index > 0, **ddp_kwargs)
             for index, chunk in enumerate(model)]
    if data_parallel_random_init:
        for chunk in model:
            chunk.broadcast_params()
    return model


def _fsdp2_chunk(model_config: Any, chunk: torch.nn.Module, ddp_config: DistributedDataParallelConfig | None,
                 pg_collection: Any) -> torch.nn.Module:
    """``chunk`` sharded by FSDP2, with ``ddp_config``'s fields as a ``TorchFullyShardedDataParallelConfig``."""
    if not isinstance(ddp_config, TorchFullyShardedDataParallelConfig):
        ddp_config = TorchFullyShardedDataParallelConfig(**asdict(ddp_config or DistributedDataParallelConfig()))
    kwargs = {"pg_collection": pg_collection} if pg_collection is not None else {}
    return TorchFullyShardedDataParallel(model_config, ddp_config, chunk, **kwargs)


def _per_chunk(model: list[torch.nn.Module], attr: str) -> Any:
    """``[chunk.<attr> for chunk in model]``, or the single one for one chunk (the schedules accept both)."""
    funcs = [getattr(chunk, attr) for chunk in model]
    return funcs[0] if len(funcs) == 1 else funcs


def configure_model_hooks(config: Any, model: torch.nn.Module | list[torch.nn.Module], optimizer: Any = None, *,
                          align_grad_reduce: bool = False) -> None:
    """Set the schedule hooks on ``config`` for ``model`` (the chunks :func:`get_model` returned).

    - ``grad_scale_func``: ``optimizer.scale_loss`` (``None`` without an optimizer);
    - ``finalize_model_grads_func``: :func:`~megatron_core.distributed.finalize_model_grads` unless set;
    - ``no_sync_func``: each DDP (or Megatron-FSDP) chunk's ``no_sync`` (a list for several chunks) unless set, so
      gradients are reduced once, after the last microbatch;
    - ``grad_sync_func``: each chunk's ``start_grad_sync`` when its ``ddp_config.overlap_grad_reduce``
      and ``align_grad_reduce`` (the interleaved schedule then launches each chunk's reduction itself);
    - ``param_sync_func``: each chunk's ``start_param_sync`` when ``overlap_param_gather`` and
      ``align_param_gather`` are both set in its ``ddp_config``.

    ``ValueError`` when a custom ``no_sync_func`` is set together with ``overlap_grad_reduce``.
    """
    chunks = model if isinstance(model, list) else [model]
    config.grad_scale_func = optimizer.scale_loss if optimizer is not None else None
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    ddp_chunks = [chunk for chunk in chunks if isinstance(chunk, (DistributedDataParallel, FullyShardedDataParallel))]
    if len(ddp_chunks) != len(chunks):
        return
    ddp_config = chunks[0].ddp_config
    if ddp_config.overlap_grad_reduce and config.no_sync_func is not None:
        raise ValueError("config.no_sync_func must be None with ddp_config.overlap_grad_reduce=True: "
                         "configure_model_hooks sets it to each chunk's no_sync")
    if config.no_sync_func is None:
        config.no_sync_func = _per_chunk(chunks, "no_sync")
    if ddp_config.overlap_grad_reduce and align_grad_reduce:
        config.grad_sync_func = _per_chunk(chunks, "start_grad_sync")
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = _per_chunk(chunks, "start_param_sync")
