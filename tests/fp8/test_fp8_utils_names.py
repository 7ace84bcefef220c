"""Megatron-Core 0.19's ``fp8_utils`` names on this library's FP8 tensors and layers."""

from __future__ import annotations

import importlib.util
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from megatron_core import fp8_utils
from megatron_core.distributed.fp8_params import (
    copy_tensor_to_quantized_param,
    dequantize_fp8_tensor,
    make_fp8_param,
)
from megatron_core.enums import Fp8Recipe
from megatron_core.extensions import _te_loader
from megatron_core.extensions.transformer_engine import (
    TEColumnParallelLinear,
    TELayerNormColumnParallelLinear,
    TERowParallelLinear,
)
from megatron_core.fp8 import convert_to_float8
from megatron_core.fp8.fp8_param_linear import _weight_transpose, allocate_weight_transpose
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer import TransformerConfig
from tests.models.gpt_test_utils import build, llama_like

TE_PREDICATES = (fp8_utils.is_mxfp8tensor, fp8_utils.is_grouped_tensor,
                 fp8_utils.is_grouped_tensor_with_quantized_storage, fp8_utils.is_grouped_mxfp8tensor)


def _fp8_param(seed: int = 0, shape: tuple[int, int] = (32, 48)) -> torch.nn.Parameter:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return make_fp8_param(torch.nn.Parameter(weight))


def test_have_te_flags():
    assert fp8_utils.HAVE_TE == (importlib.util.find_spec("transformer_engine") is not None) == _te_loader.HAVE_TE
    assert fp8_utils.HAVE_TE_FP8_TENSOR_CLASS == fp8_utils.HAVE_TE


@pytest.mark.parametrize("start,end", [(1, 1), (2, 0), (0, 3)])
def test_first_last_bf16_rule_is_the_one_convert_to_float8_applies(start, end):
    spec = llama_like(num_layers=4, fp8="e4m3", fp8_recipe="tensorwise", fp8_param=True, first_last_layers_bf16=True,
                      num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=end)
    model = build(spec)
    converted = convert_to_float8(model, emulate=True)
    fp8_layers = {int(name.split(".")[2]) for name in converted}
    expected = {i for i in range(4) if not fp8_utils.is_first_last_bf16_layer(model.config, i)}
    assert fp8_layers == expected == set(range(start, 4 - end))


def test_first_last_bf16_rule_by_hand():
    cfg = SimpleNamespace(first_last_layers_bf16=True, num_layers=6, num_layers_at_start_in_bf16=2,
                          num_layers_at_end_in_bf16=1)
    assert [fp8_utils.is_first_last_bf16_layer(cfg, i) for i in range(6)] == [True, True, False, False, False, True]
    assert not fp8_utils.is_first_last_bf16_layer(cfg, -1)
    cfg.first_last_layers_bf16 = False
    assert not any(fp8_utils.is_first_last_bf16_layer(cfg, i) for i in range(6))


def test_fp8_align_size():
    assert fp8_utils.get_fp8_align_size("mxfp8") == fp8_utils.get_fp8_align_size(Fp8Recipe.mxfp8) == 32
    assert {fp8_utils.get_fp8_align_size(r) for r in ("tensorwise", Fp8Recipe.delayed, "blockwise", None)} == {16}


def test_parallel_linear_predicates():
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    column = ColumnParallelLinear(32, 64, config=cfg, init_method=torch.nn.init.zeros_, bias=False)
    row = RowParallelLinear(64, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=False,
                            input_is_parallel=True, skip_bias_add=False)
    model = build(llama_like(fp8="e4m3", fp8_recipe="delayed"))
    convert_to_float8(model, emulate=True)
    fp8_column = model.decoder.layers[0].mlp.linear_fc1
    fp8_row = model.decoder.layers[0].mlp.linear_fc2
    for module in (column, fp8_column, object.__new__(TEColumnParallelLinear),
                   object.__new__(TELayerNormColumnParallelLinear)):
        assert fp8_utils.is_column_parallel_linear(module) and not fp8_utils.is_row_parallel_linear(module)
    for module in (row, fp8_row, object.__new__(TERowParallelLinear)):
        assert fp8_utils.is_row_parallel_linear(module) and not fp8_utils.is_column_parallel_linear(module)
    for other in (torch.nn.Linear(2, 2), model.embedding, None):
        assert not fp8_utils.is_column_parallel_linear(other) and not fp8_utils.is_row_parallel_linear(other)


def test_te_predicates_are_false_for_our_tensors():
    param = _fp8_param()
    expert = make_fp8_param(torch.nn.Parameter(torch.randn(2, 32, 16)), scaling="rowwise")
    for tensor in (param, expert, param.data, torch.randn(3), torch.nn.Parameter(torch.randn(3))):
        assert not any(predicate(tensor) for predicate in TE_PREDICATES)
    with pytest.raises(ValueError, match="GroupedTensor with quantized storage"):
        fp8_utils.get_grouped_quantized_members(expert)
    with pytest.raises(ValueError, match="expects a Transformer Engine GroupedTensor"):
        fp8_utils.modify_grouped_tensor_rowwise_storage(expert, torch.empty(expert.numel()))


class _Recipe:
    def __init__(self, mxfp8: bool) -> None:
        self._mxfp8 = mxfp8

    def mxfp8(self) -> bool:
        return self._mxfp8


class _FakeGroupedTensor:
    """Stands for Transformer Engine's ``GroupedTensor`` (its attributes Megatron-Core reads)."""

    def __init__(self, rowwise_data: torch.Tensor, mxfp8: bool = False) -> None:
        self.rowwise_data = rowwise_data
        self.columnwise_data = torch.empty(1)
        self.quantized_tensors = None
        self.quantizer = SimpleNamespace(_get_compatible_recipe=lambda: _Recipe(mxfp8))
        self.splits = 0

    def split_into_quantized_tensors(self) -> list[torch.Tensor]:
        self.splits += 1
        return list(self.rowwise_data.view(2, -1).unbind(0))


@pytest.fixture
def fake_te_grouped(monkeypatch):
    module = types.ModuleType("transformer_engine.pytorch.tensor.grouped_tensor")
    module.GroupedTensor = _FakeGroupedTensor
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return _FakeGroupedTensor


def test_grouped_tensor_helpers_on_transformer_engine_tensors(fake_te_grouped):
    quantized = fake_te_grouped(torch.arange(8, dtype=torch.uint8), mxfp8=True)
    high = fake_te_grouped(torch.arange(8, dtype=torch.float32))
    assert fp8_utils.is_grouped_tensor(quantized) and fp8_utils.is_grouped_tensor(high)
    assert fp8_utils.is_grouped_tensor_with_quantized_storage(quantized)
    assert not fp8_utils.is_grouped_tensor_with_quantized_storage(high)
    assert fp8_utils.is_grouped_mxfp8tensor(quantized) and not fp8_utils.is_grouped_mxfp8tensor(high)
    with pytest.raises(RuntimeError, match="no cached member tensors"):
        fp8_utils.get_grouped_quantized_members(quantized)
    members = fp8_utils.get_grouped_quantized_members(quantized, create_if_missing=True)
    assert fp8_utils.get_grouped_quantized_members(quantized) is members and quantized.splits == 1
    assert [m.tolist() for m in members] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    storage = torch.zeros(2, 4)
    fp8_utils.modify_grouped_tensor_rowwise_storage(high, storage)
    assert storage.view(-1).tolist() == list(range(8)) and high.rowwise_data.data_ptr() == storage.data_ptr()
    assert high.columnwise_data is None and high.quantized_tensors is None
    with pytest.raises(ValueError, match="only high-precision"):
        fp8_utils.modify_grouped_tensor_rowwise_storage(quantized, torch.zeros(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="new storage has 7 elements"):
        fp8_utils.modify_grouped_tensor_rowwise_storage(high, torch.zeros(7))


@pytest.mark.parametrize("buffer_dtype", [torch.uint8, torch.float8_e4m3fn])
def test_modify_underlying_storage_moves_fp8_bytes_into_a_buffer(buffer_dtype):
    param = _fp8_param()
    before_bytes = param.detach().view(torch.uint8).clone()
    before_value = dequantize_fp8_tensor(param).clone()
    buffer = torch.zeros(param.numel() + 10, dtype=torch.uint8).view(buffer_dtype)
    fp8_utils.modify_underlying_storage(param, buffer[5:5 + param.numel()])
    assert param.data_ptr() == buffer[5:].data_ptr() and param.dtype == torch.float8_e4m3fn
    assert torch.equal(param.detach().view(torch.uint8), before_bytes)
    assert torch.equal(buffer.view(torch.uint8)[5:5 + param.numel()].view(param.shape), before_bytes)
    assert torch.equal(dequantize_fp8_tensor(param), before_value)
    with pytest.raises(ValueError, match="needs 1536 bytes"):
        fp8_utils.modify_underlying_storage(param, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expects an FP8 parameter"):
        fp8_utils.modify_underlying_storage(torch.nn.Parameter(torch.zeros(4)), torch.zeros(4))


def test_post_all_gather_processing_refreshes_the_transposed_codes():
    param, plain = _fp8_param(0), torch.nn.Parameter(torch.randn(4, 4))
    allocate_weight_transpose(param)
    fp8_utils.post_all_gather_processing(param)  # one tensor, as well as a list
    assert torch.equal(param.fp8_transpose.view(torch.uint8), param.detach().t().contiguous().view(torch.uint8))
    copy_tensor_to_quantized_param(param, torch.randn(32, 48, generator=torch.Generator().manual_seed(7)))
    assert not torch.equal(param.fp8_transpose.view(torch.uint8), param.detach().t().contiguous().view(torch.uint8))
    plain_before = plain.detach().clone()
    fp8_utils.post_all_gather_processing([param, plain, _fp8_param(1)])  # the last has no cache: left alone
    expected = _weight_transpose(param.detach(), emulate=True)
    assert torch.equal(param.fp8_transpose.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(plain.detach(), plain_before)


def test_post_all_gather_processing_refreshes_the_experts_grouped_transposed_codes():
    from megatron_core.distributed.fp8_params import make_fp8_param
    from megatron_core.fp8.grouped_weight_cache import allocate_grouped_weight_caches

    gen = torch.Generator().manual_seed(3)
    param = make_fp8_param(torch.nn.Parameter(torch.randn(2, 32, 48, generator=gen)), scaling="rowwise")
    allocate_grouped_weight_caches(SimpleNamespace(weight=param))
    assert param.fp8_transpose.shape == (2, 48, 32)
    fp8_utils.post_all_gather_processing([param])
    assert torch.equal(param.fp8_transpose.view(torch.uint8),
                       param.detach().transpose(1, 2).contiguous().view(torch.uint8))


def test_mxfp8_output_projection(monkeypatch):
    asked = SimpleNamespace(fp8_output_proj=True, fp8="e4m3", fp8_recipe=Fp8Recipe.mxfp8)
    assert fp8_utils.is_mxfp8_output_proj_active(asked) == fp8_utils.HAVE_TE
    monkeypatch.setattr(fp8_utils, "HAVE_TE", True)
    assert fp8_utils.is_mxfp8_output_proj_active(asked)
    assert fp8_utils.is_mxfp8_output_proj_active(SimpleNamespace(fp8_output_proj=True, fp8="e4m3", fp8_recipe="mxfp8"))
    for off in (dict(fp8_output_proj=False), dict(fp8=None), dict(fp8_recipe="tensorwise")):
        assert not fp8_utils.is_mxfp8_output_proj_active(SimpleNamespace(**{**vars(asked), **off}))
    with pytest.raises(ValueError, match="fp8_output_proj"):
        TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, fp8_output_proj=True)
