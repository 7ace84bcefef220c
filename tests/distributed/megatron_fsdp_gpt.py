"""The tiny GPT of ``fsdp_gpt`` wrapped in Megatron-FSDP's ``FullyShardedDataParallel``, and the same model in the
wrapper each strategy maps onto (test helper).

Both start from the single-process reference's TP=1 weights and train with ``fsdp_gpt.train_step`` (3 AdamW
steps, clipping, scheduler, two microbatches with ``no_sync``, ``finalize_model_grads``).
"""

from __future__ import annotations

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.device import get_current_device
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.distributed.fsdp import FullyShardedDataParallel
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from tests.distributed import fsdp_gpt as fg
from tests.models.gpt_test_utils import build, llama_like, shard

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


def _model(initial: dict, tp: int, **overrides) -> torch.nn.Module:
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = build(llama_like(**overrides), tensor_model_parallel_size=tp).to(get_current_device())
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, initial[name], tp, tp_rank, True))
    return model


def _finish(wrapped: torch.nn.Module, use_distributed_optimizer: bool):
    config = wrapped.config
    config.no_sync_func = wrapped.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(OptimizerConfig(lr=fg.LR, weight_decay=fg.WD, clip_grad=fg.CLIP,
                                                 use_distributed_optimizer=use_distributed_optimizer), [wrapped])
    return wrapped, opt, fg.scheduler(opt)


def build_adapter(initial: dict, tp: int, strategy: str, optimizer_flag: bool = True, **ddp_fields):
    """``(adapter, optimizer, scheduler)``: Megatron-FSDP with ``strategy``; ``optimizer_flag`` is the
    ``OptimizerConfig.use_distributed_optimizer`` passed (0.19's training loop sets it; the strategy decides)."""
    model = _model(initial, tp)
    ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                               **ddp_fields)
    return _finish(FullyShardedDataParallel(model.config, ddp_config, model), optimizer_flag)


def build_direct(initial: dict, tp: int, strategy: str):
    """``(wrapper, optimizer, scheduler)``: the library wrapper ``strategy`` maps onto, built by hand."""
    model = _model(initial, tp)
    if strategy == "optim_grads_params":
        fsdp = TorchFullyShardedDataParallel(model.config, TorchFullyShardedDataParallelConfig(), model)
        return _finish(fsdp, False)
    sharded = strategy != "no_shard"
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=sharded,
                                               overlap_grad_reduce=strategy == "optim_grads")
    return _finish(DistributedDataParallel(model.config, ddp_config, model), sharded)


def full_weights(wrapped: torch.nn.Module, tp: int) -> dict[str, torch.Tensor]:
    """Every parameter of an adapter or a plain wrapper, gathered over DP and TP, in the TP=1 layout."""
    inner = wrapped.module if isinstance(wrapped, FullyShardedDataParallel) else wrapped
    return fg.full_weights(inner, tp)
