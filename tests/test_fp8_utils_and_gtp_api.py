"""Megatron-Core names that training code imports around FP8 checkpoints and generalized TP."""

from __future__ import annotations

import pytest
import torch

from megatron_core import fp8_utils
from megatron_core.tensor_parallel import gtp_api


def test_correct_amax_history_leaves_the_model_unchanged() -> None:
    torch.manual_seed(0)
    chunks = [torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 2))]
    before = [{k: v.clone() for k, v in c.state_dict().items()} for c in chunks]
    assert fp8_utils.correct_amax_history_if_needed(chunks) is None
    fp8_utils.correct_amax_history_if_needed(chunks[0])  # a single module, as some callers pass
    for chunk, state in zip(chunks, before):
        for key, value in chunk.state_dict().items():
            assert torch.equal(value, state[key]), key
    with pytest.raises(TypeError, match="torch.nn.Module chunks, got dict"):
        fp8_utils.correct_amax_history_if_needed([{}])


def test_generalized_tensor_parallelism_is_reported_missing() -> None:
    assert gtp_api.HAVE_GTP is False
    with pytest.raises(ImportError):
        from megatron_core.tensor_parallel.gtp_api import wrap_module_params_gtp  # noqa: F401


def test_get_fp8_context_is_a_null_context() -> None:
    from types import SimpleNamespace

    for config in (SimpleNamespace(fp8=None, fp8_param=False), SimpleNamespace(fp8="e4m3", fp8_param=True)):
        for is_init in (False, True):
            with fp8_utils.get_fp8_context(config, layer_no=3, is_init=is_init) as ctx:
                assert ctx is None
