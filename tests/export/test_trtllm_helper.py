"""TRTLLMHelper and the TensorRT-LLM-only parts.

Without ``tensorrt_llm`` (it does not install here; the tests also hide it), the helper still constructs,
and everything that needs the package -- the helper's two public methods, ``TRTLLMEngineBuilder``,
``TRT_MODEL_CONFIG`` lookups -- raises an ``ImportError`` naming it. With a small stand-in ``tensorrt_llm``
(``Mapping`` and config classes that record their arguments), the helper's single-device export returns each
rank's hand-written weights and a config per rank with Megatron-Core's fields, FP8 scales from extra states
included.
"""

from __future__ import annotations

import io
import sys
import types

import pytest
import torch

from megatron_core.export.data_type import DataType
from megatron_core.export.export_config import ExportConfig
from megatron_core.export.model_type import ModelType
from megatron_core.export.trtllm._tensorrt_llm import HAVE_TRTLLM
from megatron_core.export.trtllm.engine_builder.trtllm_engine_builder import TRTLLMEngineBuilder
from megatron_core.export.trtllm.trt_model_config import TRT_MODEL_CONFIG
from megatron_core.export.trtllm.trtllm_helper import TRTLLMHelper
from tests.export.trtllm_reference import Shape, assert_weights_equal, expected_rank_weights
from tests.models.gpt_test_utils import build, llama_like

MISSING = r"needs the tensorrt_llm package .*pip install tensorrt-llm"


def _llama() -> tuple[dict, object]:
    torch.manual_seed(1234)
    model = build(llama_like())
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in model.state_dict().items()}, model.config


@pytest.fixture
def no_trtllm(monkeypatch):
    """Hide any installed tensorrt_llm: importing it raises ImportError."""
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)


def test_importing_needs_no_tensorrt_llm() -> None:
    if HAVE_TRTLLM:
        pytest.skip("tensorrt_llm is installed")
    assert "tensorrt_llm" not in sys.modules
    assert set(TRT_MODEL_CONFIG) == set(ModelType) and len(TRT_MODEL_CONFIG) == 8


def test_everything_needing_tensorrt_llm_raises_import_error(no_trtllm, tmp_path) -> None:
    sd, config = _llama()
    helper = TRTLLMHelper(transformer_config=config, model_type=ModelType.llama, activation="swiglu")
    with pytest.raises(ImportError, match=MISSING):
        helper.get_trtllm_pretrained_config_and_model_weights(sd, DataType.bfloat16, ExportConfig())
    with pytest.raises(ImportError, match=MISSING):
        helper.get_trtllm_pretrained_config_and_model_weights(sd, DataType.bfloat16, on_device_distributed_conversion=True,
                                                              vocab_size=64, gpus_per_node=1)
    trt_config = types.SimpleNamespace(architecture="LlamaForCausalLM")
    with pytest.raises(ImportError, match=MISSING):
        helper.build_and_save_engine(str(tmp_path), {}, trt_config)
    with pytest.raises(ImportError, match=MISSING):
        TRTLLMEngineBuilder.build_and_save_engine(str(tmp_path), {}, trt_config)
    with pytest.raises(ImportError, match=MISSING):
        TRT_MODEL_CONFIG[ModelType.llama]


def test_helper_settings_and_errors() -> None:
    _, config = _llama()
    custom = {"decoder.layers.mlp.linear_fc1.weight": "x"}
    helper = TRTLLMHelper(transformer_config=config, model_type=ModelType.nemotron_nas, trtllm_conversion_dict=custom)
    assert helper.trtllm_conversion_dict["decoder.layers.mlp.linear_fc1.weight"] == "x"
    assert helper.trtllm_conversion_dict["decoder.layers.mlp.weight"].name == "ffn_linear_weight"
    assert helper.weights_converter is None
    with pytest.raises(ValueError, match=r"position_embedding_type \('alibi'\)"):
        TRTLLMHelper(transformer_config=config, model_type=ModelType.gpt, position_embedding_type="alibi")


class _Mapping:
    def __init__(self, world_size: int, rank: int, tp_size: int, pp_size: int) -> None:
        self.world_size, self.rank, self.tp_size, self.pp_size = world_size, rank, tp_size, pp_size
        self.tp_rank, self.pp_rank = rank % tp_size, rank // tp_size

    def pp_layers(self, num_layers: int) -> list[int]:
        per = num_layers // self.pp_size
        return list(range(self.pp_rank * per, (self.pp_rank + 1) * per))

    def is_first_pp_rank(self) -> bool:
        return self.pp_rank == 0

    def is_last_pp_rank(self) -> bool:
        return self.pp_rank == self.pp_size - 1


class _Config:
    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


@pytest.fixture
def fake_trtllm(monkeypatch):
    """A stand-in tensorrt_llm with what the helper's export uses."""
    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    module("tensorrt_llm", Mapping=_Mapping)
    module("tensorrt_llm.models.llama.config", LLaMAConfig=type("LLaMAConfig", (_Config,), {}))
    module("tensorrt_llm.functional", non_gated_version=lambda act: {"swiglu": "silu", "geglu": "gelu"}.get(act, act))
    renormalize = types.SimpleNamespace(RENORMALIZE="renormalize")
    module("tensorrt_llm.layers", MoeConfig=types.SimpleNamespace(ExpertScaleNormalizationMode=renormalize))


def _fp8_extra_state(weight_scale: float) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save({"scale_fwd": torch.tensor([2.0, weight_scale]), "scale_inv_fwd": torch.tensor([0.5, 1 / weight_scale])},
               buffer)
    return buffer


def test_single_device_export_through_a_stand_in_tensorrt_llm(fake_trtllm) -> None:
    sd, config = _llama()
    sd["decoder.layers.1.mlp.linear_fc1._extra_state"] = _fp8_extra_state(4.0)
    helper = TRTLLMHelper(transformer_config=config, model_type=ModelType.llama, position_embedding_type="rope",
                          max_position_embeddings=16, activation="swiglu")
    weights, configs = helper.get_trtllm_pretrained_config_and_model_weights(
        dict(sd), DataType.float32, ExportConfig(inference_tp_size=2), fp8_quantized=True, fp8_kvcache=True)
    assert [c.mapping.rank for c in configs] == [0, 1] and configs[0] is not configs[1]
    shape = Shape(config.num_layers, config.num_attention_heads, config.num_query_groups, True)
    for rank, rank_weights in enumerate(weights):
        expected = expected_rank_weights(sd, shape, 2, rank, parallel_embedding=False)
        for kind in ("fc", "gate"):  # the extra state's weight scale 4 goes to the gated fc1's both halves
            name = f"transformer.layers.1.mlp.{kind}.weight"
            expected[name] = (expected[name] * 4.0).to(torch.float8_e4m3fn)
            expected[f"transformer.layers.1.mlp.{kind}.weights_scaling_factor"] = torch.tensor([0.25])
            expected[f"transformer.layers.1.mlp.{kind}.activation_scaling_factor"] = torch.tensor([0.5])
        for layer in range(config.num_layers):
            expected[f"transformer.layers.{layer}.attention.kv_cache_scaling_factor"] = torch.tensor([1.0])
        assert_weights_equal(rank_weights, expected)
    fields = vars(configs[1])
    assert fields["architecture"] == "LlamaForCausalLM" and fields["hidden_act"] == "silu"
    assert (fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_size"]) == (8, 4, 4)
    assert (fields["vocab_size"], fields["tp_size"], fields["pp_size"], fields["world_size"]) == (64, 2, 1, 2)
    assert fields["position_embedding_type"] == "rope_gpt_neox" and fields["gpus_per_node"] == 2
    assert fields["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    assert fields["moe_normalization_mode"] == "renormalize" and fields["dtype"] == "float32"


def test_export_argument_errors(fake_trtllm) -> None:
    sd, config = _llama()
    helper = TRTLLMHelper(transformer_config=config, model_type=ModelType.falcon)
    with pytest.raises(ValueError, match=r"vocab_size \(64\) must be None"):
        helper.get_trtllm_pretrained_config_and_model_weights(dict(sd), DataType.float32, vocab_size=64)
    with pytest.raises(ValueError, match=r"gpus_per_node \(None\) is required.*export_config.*model_type"):
        helper.get_trtllm_pretrained_config_and_model_weights(
            dict(sd), DataType.float32, ExportConfig(), on_device_distributed_conversion=True, vocab_size=64)
