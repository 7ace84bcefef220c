"""DDP buffer layouts at Megatron-Core's path; the code lives in :mod:`megatron_core.distributed.param_layout`
(the buffers it places belong to ``distributed``)."""

from megatron_core.distributed.param_layout import (
    BufferKey,
    FullParamLayout,
    PerBufferParamLayout,
    bucket_end_divisor,
    pad_bucket_end,
    pad_param_start,
    pad_to_divisor,
)

__all__ = [
    "BufferKey",
    "FullParamLayout",
    "PerBufferParamLayout",
    "bucket_end_divisor",
    "pad_bucket_end",
    "pad_param_start",
    "pad_to_divisor",
]
