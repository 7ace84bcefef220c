"""DistributedDataParallelConfig: conflicting fields raise an error that is a ValueError and, as Megatron-Core's
assert, an AssertionError."""

from __future__ import annotations

import pytest

from megatron_core.distributed import DistributedDataParallelConfig


@pytest.mark.parametrize("kind", [ValueError, AssertionError])
def test_fp32_local_accumulation_conflicts_with_grad_reduce_in_fp32(kind):
    with pytest.raises(kind, match="param_name_patterns_for_fp32_local_accumulation"):
        DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                      param_name_patterns_for_fp32_local_accumulation=("all",))
    DistributedDataParallelConfig(grad_reduce_in_fp32=False, param_name_patterns_for_fp32_local_accumulation=("all",))
