"""The module-level ``logger`` of Megatron-Core 0.19's modules, named after the module and used where 0.19 logs:
mismatched factory merges, model tensors the optimizer does not track, failed checkpoint writes, the DDP
config and the gradient buckets."""

from __future__ import annotations

import importlib
import logging
import queue

import pytest
import torch

from megatron_core.dist_checkpointing import CheckpointingException
from megatron_core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory, apply_factory_merges
from megatron_core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
from megatron_core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.distributed.param_and_grad_buffer import _ParamAndGradBuffer

MODULES = ["megatron_core.dist_checkpointing.mapping", "megatron_core.dist_checkpointing.optimizer",
           "megatron_core.dist_checkpointing.strategies.filesystem_async",
           "megatron_core.dist_checkpointing.strategies.torch",
           "megatron_core.dist_checkpointing.strategies.state_dict_saver",
           "megatron_core.distributed.distributed_data_parallel", "megatron_core.distributed.param_and_grad_buffer",
           "megatron_core.inference.utils"]


@pytest.mark.parametrize("name", MODULES)
def test_logger_is_named_after_its_module(name):
    assert importlib.import_module(name).logger is logging.getLogger(name)


def _factory(key: str) -> ShardedTensorFactory:
    return ShardedTensorFactory(key, torch.zeros(2), lambda k, t, r, f=None: [], lambda parts: parts)


def test_mismatched_factory_merge_is_logged(caplog):
    with caplog.at_level(logging.ERROR, logger="megatron_core.dist_checkpointing.mapping"):
        with pytest.raises(CheckpointingException, match="1 loaded values for 2 factories"):
            apply_factory_merges({"l": [1]}, {"l": [_factory("a"), _factory("b")]})
    assert "1 loaded values for 2 factories" in caplog.text and "factories:" in caplog.text


def test_untracked_model_tensors_are_logged(caplog):
    weight, other = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    state = {"w": ShardedTensor.from_rank_offsets("w", weight), "o": ShardedTensor.from_rank_offsets("o", other)}
    with caplog.at_level(logging.DEBUG, logger="megatron_core.dist_checkpointing.optimizer"):
        assert list(get_param_id_to_sharded_param_map(state, [weight])) == [0]
    assert "o is not tracked by the optimizer" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="megatron_core.dist_checkpointing.optimizer"):
        assert get_param_id_to_sharded_param_map({"w": ShardedTensor.from_rank_offsets("w", torch.ones(2))},
                                                 [weight]) == {}
    assert "keep_vars=True" in caplog.text


def test_failed_checkpoint_write_is_logged(tmp_path, caplog):
    writer = FileSystemWriterAsync(tmp_path / "missing" / "dir")
    writer._plan = None  # nothing planned: the write fails inside DCP's writer
    results: queue.Queue = queue.Queue()
    with caplog.at_level(logging.ERROR, logger="megatron_core.dist_checkpointing.strategies.filesystem_async"):
        writer._write_staged(0, [], results)
    assert "rank 0: writing checkpoint files" in caplog.text and isinstance(results.get_nowait()[1], Exception)


def test_gradient_buckets_are_logged_at_debug(caplog):
    params = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(6))]
    names = {params[0]: "layer.weight", params[1]: "layer.bias"}
    with caplog.at_level(logging.DEBUG, logger="megatron_core.distributed.param_and_grad_buffer"):
        buffer = _ParamAndGradBuffer(DistributedDataParallelConfig(), torch.float32, torch.float32,
                                     list(names.items()), None, None, names, 1.0, device=torch.device("cpu"))
    assert f"{len(buffer.buckets)} bucket(s)" in caplog.text
    assert "layer.weight" in caplog.text and "layer.bias" in caplog.text
