"""Megatron-FSDP settings this library cannot serve raise a ``ValueError`` naming them; the ones it serves are
accepted; ``get_model`` / ``configure_model_hooks`` / ``get_megatron_optimizer`` / ``unwrap_model`` handle the
wrapper (a ``get_model``-built ``optim_grads`` model trains like single-process training)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_core import parallel_state
from megatron_core._ground import unwrap_model
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallelConfig,
)
from megatron_core.distributed.fsdp import FullyShardedDataParallel
from megatron_core.models.gpt import GPTModel
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.distributed import fsdp_gpt as fg
from tests.models.gpt_test_utils import build, gpt2_like, gpt_provider, llama_like

REFUSED = [
    ("fsdp_double_buffer", True), ("megatron_fsdp_max_pool_double_buffer", True), ("fsdp_manual_registration", True),
    ("keep_fp8_transpose_cache", True), ("megatron_fsdp_use_decoupled_grad", True),
    ("megatron_fsdp_cuda_graph_mode", True), ("megatron_fsdp_enable_fine_grained_param_gather", True),
    ("fp8_param_gather", True), ("outer_dp_sharding_strategy", "optim"), ("outer_dp_sharding_strategy", "bogus"),
    ("megatron_fsdp_main_params_dtype", None), ("megatron_fsdp_main_params_dtype", torch.bfloat16),
    ("megatron_fsdp_main_grads_dtype", torch.bfloat16), ("megatron_fsdp_grad_comm_dtype", torch.bfloat16),
]


@pytest.mark.parametrize("name,value", REFUSED, ids=lambda v: str(v))
def test_unservable_megatron_fsdp_options_raise_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        DistributedDataParallelConfig(use_megatron_fsdp=True, **{name: value})
    if name != "fp8_param_gather":  # without use_megatron_fsdp 0.19 ignores them
        DistributedDataParallelConfig(**{name: value})


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
def test_hsdp_needs_a_distributed_optimizer_strategy(strategy):
    with pytest.raises(ValueError, match=f"num_distributed_optimizer_instances \\(2\\).*{strategy}"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                      num_distributed_optimizer_instances=2)


def test_served_megatron_fsdp_options_are_accepted():
    config = DistributedDataParallelConfig(
        use_custom_fsdp=True, data_parallel_sharding_strategy="optim_grads", overlap_param_gather=True,
        num_distributed_optimizer_instances=2, megatron_fsdp_main_grads_dtype=torch.float32,
        megatron_fsdp_grad_comm_dtype=torch.float32, suggested_communication_unit_size=1000,
        fsdp_all_gather_in_start_param_sync=False, disable_symmetric_registration=True,
        fsdp_db_use_persist_buf_on_alloc_fail=True)
    assert config.use_megatron_fsdp  # the deprecated alias
    with pytest.raises(ValueError, match="data_parallel_sharding_strategy \\('zero3'\\)"):
        DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="zero3")
    with pytest.raises(ValueError, match="overlap_param_gather=True needs use_distributed_optimizer"):
        DistributedDataParallelConfig(overlap_param_gather=True)  # without Megatron-FSDP, as before


def _wrapper_errors() -> list[str]:
    parallel_state.initialize_model_parallel()
    try:
        model = build(llama_like())
        config = DistributedDataParallelConfig(fsdp_double_buffer=True)  # use_megatron_fsdp off: checked by the wrapper
        with pytest.raises(ValueError, match="fsdp_double_buffer"):
            FullyShardedDataParallel(model.config, config, model)
        meta = build(llama_like(), init_model_with_meta_device=True)
        with pytest.raises(ValueError, match="init_model_with_meta_device"):
            FullyShardedDataParallel(meta.config, DistributedDataParallelConfig(use_megatron_fsdp=True), meta)
        tied = build(gpt2_like())
        zero3 = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
        with pytest.raises(ValueError, match="share_embeddings_and_output_weights"):
            FullyShardedDataParallel(tied.config, zero3, tied)
        adapter = FullyShardedDataParallel(model.config, DistributedDataParallelConfig(use_megatron_fsdp=True), model)
        assert unwrap_model(adapter) is model and unwrap_model([adapter]) == [model]
        plain = build(llama_like())
        ddp = DistributedDataParallel(plain.config, DistributedDataParallelConfig(), plain)
        with pytest.raises(ValueError, match="every model chunk wrapped in FullyShardedDataParallel"):
            get_megatron_optimizer(OptimizerConfig(lr=1e-3), [adapter, ddp])
        with pytest.raises(ValueError, match="use_torch_fsdp2=True and ddp_config.use_megatron_fsdp=True"):
            get_model(partial(gpt_provider, llama_like()), config=TransformerConfig(**llama_like()["config"]),
                      ddp_config=TorchFullyShardedDataParallelConfig(use_megatron_fsdp=True), use_torch_fsdp2=True)
        return ["ok"]
    finally:
        parallel_state.destroy_model_parallel()


def test_megatron_fsdp_wrapper_refuses_what_it_cannot_serve():
    assert run_on_ranks(2, _wrapper_errors) == [["ok"], ["ok"]]


def _get_model_trains() -> list[float]:
    initial, ref_losses, _ = fg.reference()
    parallel_state.initialize_model_parallel()
    try:
        config = TransformerConfig(**llama_like()["config"])
        ddp_config = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads")
        model = get_model(partial(gpt_provider, llama_like()), config=config, ddp_config=ddp_config)
        assert isinstance(model[0], FullyShardedDataParallel) and ddp_config.overlap_grad_reduce
        inner = unwrap_model(model[0])
        assert isinstance(inner, GPTModel)
        with torch.no_grad():
            for name, param in inner.named_parameters():
                param.copy_(initial[name])
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=fg.LR, weight_decay=fg.WD, clip_grad=fg.CLIP,
                                                           use_distributed_optimizer=True), model)
        configure_model_hooks(config, model, optimizer)
        assert config.no_sync_func == model[0].no_sync  # overlapped reductions wait for the last microbatch
        sched = fg.scheduler(optimizer)
        losses = [fg.train_step(model[0], optimizer, sched, step) for step in range(fg.STEPS)]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
        return losses
    finally:
        parallel_state.destroy_model_parallel()


def test_get_model_builds_megatron_fsdp_and_it_trains_like_single_process():
    results = run_on_ranks(2, _get_model_trains)
    assert results[0] == results[1]
