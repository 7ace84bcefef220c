"""tensor_parallel attribute helpers and LanguageModule's loss read on a bare module (Megatron-Core 0.19)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from megatron_core.models.common.language_module import language_module
from megatron_core.tensor_parallel import (
    copy_tensor_model_parallel_attributes,
    param_is_not_tensor_parallel_duplicate,
)


class _Group:
    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank


def test_copy_keeps_qkv_split_and_expert_marks():
    source, destination = torch.empty(4), torch.empty(4)
    source.is_qkv, source.qkv_split_shapes, source.expert_tp, source.partition_dim = True, [2, 1, 1], True, 0
    copy_tensor_model_parallel_attributes(destination, source)
    assert (destination.is_qkv, destination.qkv_split_shapes, destination.expert_tp, destination.partition_dim) == (
        True, [2, 1, 1], True, 0)


def test_duplicate_filter_asks_the_explicit_group_and_experts_use_expert_tp():
    param = torch.empty(1)
    assert not param_is_not_tensor_parallel_duplicate(param, _Group(1))
    assert param_is_not_tensor_parallel_duplicate(param, _Group(0))
    param.allreduce = False
    assert param_is_not_tensor_parallel_duplicate(param, tp_group=_Group(1), expert_tp_group=_Group(0))
    assert not param_is_not_tensor_parallel_duplicate(param, tp_group=_Group(0), expert_tp_group=_Group(1))
    param.tensor_model_parallel = True
    assert param_is_not_tensor_parallel_duplicate(param, _Group(3))


def test_unfused_loss_reads_fp16_flag_from_the_config():
    module = SimpleNamespace(config=SimpleNamespace(cross_entropy_loss_fusion=False), tp_group=None)
    labels = torch.tensor([[0, 1, 2], [2, 1, 0]])
    logits = torch.randn(3, 2, 4, dtype=torch.bfloat16)
    loss = language_module.LanguageModule.compute_language_model_loss(module, labels=labels, logits=logits)
    expected = torch.nn.functional.cross_entropy(logits.float().reshape(6, 4), labels.t().reshape(6),
                                                 reduction="none").reshape(3, 2).t()
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    torch.testing.assert_close(loss, expected)
    module.config.fp16_lm_cross_entropy = True
    loss16 = language_module.LanguageModule.compute_language_model_loss(module, labels=labels, logits=logits)
    torch.testing.assert_close(loss16.float(), expected, rtol=2e-2, atol=2e-2)
