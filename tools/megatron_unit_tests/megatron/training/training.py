"""``get_args`` and ``get_model`` of the stand-in ``megatron.training``, on ``megatron_core``'s model builder."""

from __future__ import annotations

from megatron.training.global_vars import get_args

from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.enums import ModelType
from megatron_core.training import model_builder


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp: bool = True):
    """Megatron-LM's ``get_model``: the DDP settings are read from ``get_args()``."""
    args = get_args()
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
        bucket_size=args.ddp_bucket_size,
        average_in_collective=args.ddp_average_in_collective,
    )

    def provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
        kwargs = {"pre_process": pre_process, "post_process": post_process}
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        return model_provider_func(**kwargs)

    return model_builder.get_model(provider, model_type, wrap_with_ddp, ddp_config=ddp_config,
                                   virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
                                   data_parallel_random_init=args.data_parallel_random_init)


def preprocess_common_state_dict(common_state_dict):
    """Not provided by the stand-in: the test is skipped."""
    import pytest

    pytest.skip("megatron.training.training.preprocess_common_state_dict is not part of the CPU harness")
