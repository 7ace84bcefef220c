"""``training.model_builder``: ``get_model`` gives each virtual stage the right ``pre_process`` /
``post_process`` flags and wraps it (Float16Module, DDP); ``configure_model_hooks`` sets the config hooks.

PP=2 with two virtual stages per rank on two CPU ranks: rank 0 holds global stages 0 and 2, rank 1
stages 1 and 3; only stage 0 embeds and only stage 3 computes the loss.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.models.gpt import GPTModel
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.training.model_builder import configure_model_hooks, get_model
from megatron_core.transformer import TransformerConfig
from megatron_core.transformer.enums import ModelType
from megatron_core.transformer.module import Float16Module
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import gpt_provider, llama_like


def _config(pp: int = 1, vpp: int | None = None, bf16: bool = False) -> TransformerConfig:
    dtype = torch.bfloat16 if bf16 else torch.float32
    return TransformerConfig(**{**llama_like(num_layers=4)["config"], "pipeline_model_parallel_size": pp,
                                "virtual_pipeline_model_parallel_size": vpp, "bf16": bf16, "params_dtype": dtype,
                                "pipeline_dtype": dtype})


def _recording_provider(calls: list, **kwargs):
    calls.append({k: v for k, v in kwargs.items() if k != "pg_collection"})
    return gpt_provider(llama_like(), **kwargs)


def _inner(chunk: torch.nn.Module) -> GPTModel:
    while not isinstance(chunk, GPTModel):
        chunk = chunk.module
    return chunk


def _virtual_stages(bf16: bool) -> dict:
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    try:
        config = _config(pp=2, vpp=2, bf16=bf16)
        calls: list = []
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=bf16, use_distributed_optimizer=True,
                                                   overlap_param_gather=True, align_param_gather=True)
        model = get_model(partial(_recording_provider, calls), config=config, ddp_config=ddp_config)
        optimizer = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=bf16, use_distributed_optimizer=True), model)
        configure_model_hooks(config, model, optimizer)
        return {
            "calls": [(c["pre_process"], c["post_process"], c["vp_stage"]) for c in calls],
            "flags": [(_inner(m).pre_process, _inner(m).post_process, _inner(m).vp_stage) for m in model],
            "ddp": [isinstance(m, DistributedDataParallel) for m in model],
            "fp16": [isinstance(m.module, Float16Module) for m in model],
            "model_type": [_inner(m).model_type == ModelType.encoder_or_decoder for m in model],
            "bucketing_off": [m.bucket_size is None for m in model],
            "no_sync": config.no_sync_func == [m.no_sync for m in model],
            "param_sync": config.param_sync_func == [m.start_param_sync for m in model],
            "grad_sync_unset": config.grad_sync_func is None,
            "grad_scale": config.grad_scale_func == optimizer.scale_loss,
            "finalize": config.finalize_model_grads_func is finalize_model_grads,
            "tp_attrs": all(hasattr(p, "partition_dim") for m in model for p in m.parameters()),
        }
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_virtual_pipeline_stages_get_their_flags_and_wrappers(bf16: bool) -> None:
    expected_flags = [[(True, False, 0), (False, False, 1)], [(False, False, 0), (False, True, 1)]]
    for rank, result in enumerate(run_on_ranks(2, _virtual_stages, bf16)):
        assert result["calls"] == expected_flags[rank], (rank, result)
        assert result["flags"] == expected_flags[rank], (rank, result)
        assert result["ddp"] == [True, True] and result["fp16"] == [bf16, bf16], (rank, result)
        assert all(result["model_type"]) and result["tp_attrs"], (rank, result)
        assert result["bucketing_off"][1], (rank, result)  # only the first chunk may use buckets
        for hook in ("no_sync", "param_sync", "grad_sync_unset", "grad_scale", "finalize"):
            assert result[hook], (rank, hook, result)


def test_one_stage_without_ddp_and_hooks_without_optimizer() -> None:
    config = _config()
    calls: list = []
    model = get_model(partial(_recording_provider, calls), wrap_with_ddp=False, config=config)
    assert calls == [{"pre_process": True, "post_process": True, "config": config}]
    assert len(model) == 1 and isinstance(model[0], GPTModel)
    assert model[0].pre_process and model[0].post_process
    configure_model_hooks(config, model)
    assert config.grad_scale_func is None and config.no_sync_func is None
    assert config.finalize_model_grads_func is finalize_model_grads


def _single_chunk_and_bad_hooks() -> dict:
    parallel_state.initialize_model_parallel()  # DP=2
    try:
        config = _config()
        custom_finalize = lambda *args, **kwargs: None
        config.finalize_model_grads_func = custom_finalize
        model = get_model(partial(gpt_provider, llama_like()), config=config)
        configure_model_hooks(config, model[0])
        result = {"one_ddp": len(model) == 1 and isinstance(model[0], DistributedDataParallel),
                  "no_sync": config.no_sync_func == model[0].no_sync,
                  "finalize_kept": config.finalize_model_grads_func is custom_finalize,
                  "param_sync_unset": config.param_sync_func is None}
        config = _config()
        config.no_sync_func = lambda: None
        model = get_model(partial(gpt_provider, llama_like()), config=config,
                          ddp_config=DistributedDataParallelConfig(overlap_grad_reduce=True))
        try:
            configure_model_hooks(config, model)
        except ValueError as exc:
            result["error"] = str(exc)
        return result
    finally:
        parallel_state.destroy_model_parallel()


def test_single_ddp_chunk_hooks_are_not_lists_and_a_custom_no_sync_with_overlap_raises() -> None:
    for rank, result in enumerate(run_on_ranks(2, _single_chunk_and_bad_hooks)):
        assert result["one_ddp"] and result["no_sync"] and result["param_sync_unset"], (rank, result)
        assert result["finalize_kept"], (rank, result)  # a hook already set is kept
        assert "no_sync_func must be None with ddp_config.overlap_grad_reduce" in result.get("error", ""), result


def test_bad_arguments_raise_naming_them() -> None:
    provider = partial(gpt_provider, llama_like())
    with pytest.raises(ValueError, match="virtual_pipeline_model_parallel_size must be >= 1"):
        get_model(provider, config=_config(), virtual_pipeline_model_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_random_init=True needs wrap_with_ddp=True"):
        get_model(provider, wrap_with_ddp=False, config=_config(), data_parallel_random_init=True)
