"""SingleDeviceTRTLLMModelWeightsConverter: a tiny GPT's TensorRT-LLM weights equal the hand-written conversion.

Llama-like (RMSNorm, GQA, SwiGLU, no biases, separate lm head) and GPT-2-like (LayerNorm, biases, learned
positions, tied embeddings) models from tests/models/gpt_test_utils.py, converted at inference TP=1 and TP=2
(and PP=2 through ``get_local_model_weights_per_gpu``), must equal ``trtllm_reference.expected_rank_weights``
bitwise in fp32; also with fewer query groups than ranks (repeated K/V heads), a vocabulary padded for a
parallel embedding, zero-centred LayerNorm weights, weights stacked over layers, casts and FP8 scaling.
Where megatron-core is installed its own converter (unchanged from 0.16 to 0.19) must give the same weights.
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from megatron_core.export.data_type import DataType
from megatron_core.export.export_config import ExportConfig
from megatron_core.export.trtllm.model_to_trllm_mapping.default_conversion_dict import DEFAULT_CONVERSION_DICT
from megatron_core.export.trtllm.trtllm_weights_converter.single_device_trtllm_model_weights_converter import (
    SingleDeviceTRTLLMModelWeightsConverter,
    pad_vocab_size,
    str_dtype_to_torch,
)
from tests.export.trtllm_reference import Shape, assert_weights_equal, expected_rank_weights
from tests.models.gpt_test_utils import build, gpt2_like, llama_like


class FakeMapping:
    """The part of ``tensorrt_llm.Mapping`` the converter reads (even pipeline split, rank = pp * tp + tp_rank)."""

    def __init__(self, rank: int, tp_size: int, pp_size: int, num_layers: int) -> None:
        self.tp_size, self.tp_rank, self.pp_rank, self.pp_size = tp_size, rank % tp_size, rank // tp_size, pp_size
        self._per_stage = num_layers // pp_size

    def pp_layers(self, num_layers: int) -> list[int]:
        return list(range(self.pp_rank * self._per_stage, (self.pp_rank + 1) * self._per_stage))

    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1


def _model(spec: dict, **overrides) -> tuple[dict, object]:
    torch.manual_seed(1234)
    model = build(spec, **overrides)
    with torch.no_grad():  # non-trivial norm weights and biases, so a misplaced one shows
        for name, param in model.named_parameters():
            if "layernorm" in name or name.endswith("bias"):
                param.copy_(torch.randn_like(param))
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}, model.config


def _shape(config, **kw) -> Shape:
    return Shape(config.num_layers, config.num_attention_heads, config.num_query_groups,
                 bool(config.gated_linear_unit), **kw)


def _convert(sd: dict, config, tp: int = 1, pp: int = 1, parallel_embedding: bool = False,
             dtype: DataType = DataType.float32, **kwargs) -> tuple[SingleDeviceTRTLLMModelWeightsConverter, list]:
    export_config = ExportConfig(inference_tp_size=tp, inference_pp_size=pp, use_parallel_embedding=parallel_embedding)
    converter = SingleDeviceTRTLLMModelWeightsConverter(export_config, config, dtype, **kwargs)
    converter.convert(dict(sd), DEFAULT_CONVERSION_DICT)
    ranks = [converter.get_local_model_weights_per_gpu(FakeMapping(r, tp, pp, config.num_layers),
                                                       types.SimpleNamespace()) for r in range(tp * pp)]
    return converter, ranks


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_weights_equal_hand_written_conversion(family: str, tp: int) -> None:
    sd, config = _model(llama_like() if family == "llama" else gpt2_like())
    _, ranks = _convert(sd, config, tp=tp)
    for rank, weights in enumerate(ranks):
        assert_weights_equal(weights, expected_rank_weights(sd, _shape(config), tp, rank, parallel_embedding=False))


def test_tp2_layout_spelled_out() -> None:
    """Llama-like, 8 heads in 4 groups of head size 4, TP=2: rank 1 holds groups 2-3 -> Q rows of heads 4-7."""
    sd, config = _model(llama_like())
    converter, ranks = _convert(sd, config, tp=2)
    qkv = sd["decoder.layers.0.self_attention.linear_qkv.weight"]  # [4 groups * (2 q + k + v) * 4, 32]
    rank1 = ranks[1]["transformer.layers.0.attention.qkv.weight"]
    assert rank1.shape == (2 * 4 * 4, 32)  # (4 q heads + 2 k + 2 v) * head size 4
    assert torch.equal(rank1[:8], qkv[32:40])  # group 2's two query heads
    assert torch.equal(rank1[16:20], qkv[40:44])  # then the first key head of the rank: group 2's
    assert torch.equal(rank1[24:28], qkv[44:48])  # then group 2's value head
    fc1 = sd["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate 64; up 64] x 32
    assert torch.equal(ranks[1]["transformer.layers.0.mlp.fc.weight"], fc1[32:64])
    assert torch.equal(ranks[1]["transformer.layers.0.mlp.gate.weight"], fc1[96:128])
    assert torch.equal(ranks[0]["transformer.layers.1.mlp.proj.weight"], sd["decoder.layers.1.mlp.linear_fc2.weight"][:, :32])
    assert torch.equal(ranks[1]["lm_head.weight"], sd["output_layer.weight"][32:])
    assert "transformer.layers.0.attention.qkv.weight.1.bin" in converter.trtllm_model_weights
    assert converter.get_padded_vocab_size() == 64


def test_fewer_query_groups_than_ranks_repeat_kv_heads() -> None:
    sd, config = _model(llama_like(num_query_groups=1))
    for tp in (2, 4):
        _, ranks = _convert(sd, config, tp=tp)
        for rank, weights in enumerate(ranks):
            assert_weights_equal(weights, expected_rank_weights(sd, _shape(config), tp, rank, False))
        k_rows = ranks[-1]["transformer.layers.0.attention.qkv.weight"][8 // tp * 4:][:4]
        assert torch.equal(k_rows, sd["decoder.layers.0.self_attention.linear_qkv.weight"][32:36])


def test_query_groups_that_do_not_split_raise() -> None:
    sd, config = _model(llama_like(num_query_groups=2))
    with pytest.raises(ValueError, match=r"query groups \(2\).*tensor-parallel size \(3\)"):
        _convert(sd, config, tp=3)


def test_parallel_embedding_pads_vocab_and_pipeline_stages_renumber_layers() -> None:
    """GPT-2-like with a 63-row vocabulary (not divisible by TP=2): zero row appended, then split; PP=2."""
    sd, config = _model(gpt2_like())
    sd["embedding.word_embeddings.weight"] = sd["embedding.word_embeddings.weight"][:63]
    converter, ranks = _convert(sd, config, tp=2, pp=2, parallel_embedding=True)
    assert converter.get_padded_vocab_size() == 64
    shape = _shape(config)
    for rank, weights in enumerate(ranks):
        stage = rank // 2
        expected = expected_rank_weights(sd, shape, 2, rank % 2, True, layers=range(stage, stage + 1),
                                         first_stage=stage == 0, last_stage=stage == 1)
        assert_weights_equal(weights, expected)
    assert torch.equal(ranks[1]["transformer.vocab_embedding.weight"][-1], torch.zeros(32))
    assert pad_vocab_size(63, 2) == 64 and pad_vocab_size(64, 8) == 64 and pad_vocab_size(65, 8) == 72


def test_zero_centered_layernorm_gets_one_added() -> None:
    sd, config = _model(gpt2_like(layernorm_zero_centered_gamma=True))
    _, ranks = _convert(sd, config, tp=2)
    for rank, weights in enumerate(ranks):
        assert_weights_equal(weights, expected_rank_weights(sd, _shape(config, layernorm1p=True), 2, rank, False))


def test_weights_stacked_over_layers_convert_alike() -> None:
    sd, config = _model(llama_like())
    stacked = {k: v for k, v in sd.items() if not k.startswith("decoder.layers.")}
    for name in {k.split(".", 3)[3] for k in sd if k.startswith("decoder.layers.") and "_extra_state" not in k}:
        stacked[f"decoder.layers.{name}"] = torch.stack([sd[f"decoder.layers.{i}.{name}"] for i in range(2)])
    export_config = ExportConfig(inference_tp_size=2)
    by_layer = SingleDeviceTRTLLMModelWeightsConverter(export_config, config, DataType.float32)
    by_layer.convert(dict(sd), DEFAULT_CONVERSION_DICT)
    from_stack = SingleDeviceTRTLLMModelWeightsConverter(export_config, config, DataType.float32)
    from_stack.convert(stacked, DEFAULT_CONVERSION_DICT, state_dict_split_by_layer_numbers=False)
    assert_weights_equal(from_stack.trtllm_model_weights, by_layer.trtllm_model_weights)


def test_dtype_cast_and_fp8_scaling() -> None:
    sd, config = _model(llama_like())
    name = "transformer.layers.0.attention.dense"
    scales = {f"{name}.weights_scaling_factor": {"weight_multiplier": torch.tensor([4.0]),
                                                 "trt_llm_scale": torch.tensor([0.25])}}
    converter, ranks = _convert(sd, config, tp=2, dtype=DataType.bfloat16, scales=scales)
    expected = expected_rank_weights(sd, _shape(config), 2, 0, False)
    for key, value in ranks[0].items():
        if key == f"{name}.weight":
            assert value.dtype == torch.float8_e4m3fn
            assert torch.equal(value, (expected[key] * 4.0).to(torch.float8_e4m3fn))
        else:
            assert value.dtype == torch.bfloat16 and torch.equal(value, expected[key].to(torch.bfloat16)), key
    assert str_dtype_to_torch(DataType.float16) is torch.float16 and str_dtype_to_torch("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        str_dtype_to_torch("int8")


def test_unknown_key_raises() -> None:
    sd, config = _model(llama_like())
    sd["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(4)
    with pytest.raises(ValueError, match="q_layernorm.*trtllm_conversion_dict"):
        _convert(sd, config)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core (the oracle) not installed")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_matches_megatron_cores_own_converter(family: str, monkeypatch) -> None:
    """Megatron-Core's converter on the same state dict, with its two TensorRT-LLM helpers replaced by ours."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.export.data_type import DataType as TheirDataType
        from megatron.core.export.export_config import ExportConfig as TheirExportConfig
        from megatron.core.export.trtllm.model_to_trllm_mapping import default_conversion_dict as their_dicts
        from megatron.core.export.trtllm.trtllm_weights_converter import (
            single_device_trtllm_model_weights_converter as theirs,
        )
    monkeypatch.setattr(theirs, "pad_vocab_size", pad_vocab_size)
    monkeypatch.setattr(theirs, "str_dtype_to_torch", lambda dtype: str_dtype_to_torch(dtype.name))
    sd, config = _model(llama_like() if family == "llama" else gpt2_like())
    sd["embedding.word_embeddings.weight"] = sd["embedding.word_embeddings.weight"][:63]
    their_converter = theirs.SingleDeviceTRTLLMModelWeightsConverter(
        TheirExportConfig(inference_tp_size=2, use_parallel_embedding=True), config, TheirDataType.float32)
    their_converter.convert(dict(sd), their_dicts.DEFAULT_CONVERSION_DICT)
    ours, ranks = _convert(sd, config, tp=2, parallel_embedding=True)
    assert_weights_equal(ours.trtllm_model_weights, their_converter.trtllm_model_weights)
    for rank, weights in enumerate(ranks):
        mapping = FakeMapping(rank, 2, 1, config.num_layers)
        assert_weights_equal(weights, their_converter.get_local_model_weights_per_gpu(mapping, types.SimpleNamespace()))
