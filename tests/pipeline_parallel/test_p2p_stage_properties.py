"""``P2PCommunicator``'s stage queries are properties, as in Megatron-Core 0.19 (``if comm.is_pp_first_stage:``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.pipeline_parallel.p2p_communication import P2PCommunicator
from tests.dist_harness import run_on_ranks


def _stage_queries() -> tuple:
    comm = P2PCommunicator(dist.group.WORLD, ModelParallelConfig(pipeline_dtype=torch.float32))
    return comm.is_pp_first_stage, comm.is_pp_last_stage, comm.current_stage, comm.total_stages


def test_stage_queries_are_boolean_properties():
    assert run_on_ranks(2, _stage_queries) == [(True, False, 0, 2), (False, True, 1, 2)]
