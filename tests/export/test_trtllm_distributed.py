"""DistributedTRTLLMModelWeightsConverter on a real TP=2 GPTModel (2 gloo ranks).

Each rank builds the TP=1 model, then the TP=2 model under ``parallel_state`` loaded with its shard, and
converts its own state dict. Its weights must equal the hand-written conversion of the TP=1 weights for that
rank (``trtllm_reference``) and the single-device converter's weights for that rank, with the vocabulary
tables cut from the model's 64 rows to a 62-token tokenizer and split evenly. The same through an explicit
``ProcessGroupCollection``; a tokenizer vocabulary that does not split over the ranks raises.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.export.data_type import DataType
from megatron_core.export.export_config import ExportConfig
from megatron_core.export.trtllm.model_to_trllm_mapping.default_conversion_dict import DEFAULT_CONVERSION_DICT
from megatron_core.export.trtllm.trtllm_weights_converter.distributed_trtllm_model_weights_converter import (
    DistributedTRTLLMModelWeightsConverter,
)
from megatron_core.export.trtllm.trtllm_weights_converter.single_device_trtllm_model_weights_converter import (
    SingleDeviceTRTLLMModelWeightsConverter,
)
from megatron_core.process_groups_config import ProcessGroupCollection
from tests.dist_harness import run_on_ranks
from tests.export.trtllm_reference import Shape, assert_weights_equal, expected_rank_weights
from tests.models.gpt_test_utils import build, gpt2_like, llama_like, shard

TP, TOKENIZER_VOCAB = 2, 62
SPECS = {"llama": llama_like, "gpt2": gpt2_like}


def _convert_on_rank(family: str) -> dict:
    spec = SPECS[family]()
    gated = bool(spec["config"].get("gated_linear_unit"))
    torch.manual_seed(1234)
    full = {k: v for k, v in build(spec).state_dict().items() if torch.is_tensor(v)}
    for name, value in full.items():  # non-trivial norm weights and biases
        if "layernorm" in name or name.endswith("bias"):
            value.copy_(torch.randn_like(value))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = parallel_state.get_tensor_model_parallel_rank()
    model = build(spec)
    with torch.no_grad():
        for name, value in model.state_dict().items():
            if torch.is_tensor(value):
                value.copy_(shard(name, full[name], TP, rank, gated))
    local = model.state_dict()
    results = {"full": full, "rank": rank}
    for how in ("parallel_state", "pg_collection"):
        pgs = ProcessGroupCollection.use_mpu_process_groups() if how == "pg_collection" else None
        converter = DistributedTRTLLMModelWeightsConverter(model.config, DataType.float32, pg_collection=pgs)
        converter.convert(dict(local), DEFAULT_CONVERSION_DICT, tokenizer_vocab_size=TOKENIZER_VOCAB)
        assert (converter.inference_tp_size, converter.tp_rank, converter.inference_pp_size) == (TP, rank, 1)
        results[how] = converter.trtllm_model_weights
    try:
        DistributedTRTLLMModelWeightsConverter(model.config, DataType.float32).convert(
            dict(local), DEFAULT_CONVERSION_DICT, tokenizer_vocab_size=63)
    except ValueError as exc:
        results["error"] = str(exc)
    return results


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_tp2_model_converts_like_hand_written_and_single_device(family: str) -> None:
    results = run_on_ranks(TP, _convert_on_rank, family)
    full = results[0]["full"]
    config = build(SPECS[family]()).config
    shape = Shape(config.num_layers, config.num_attention_heads, config.num_query_groups, bool(config.gated_linear_unit))
    trimmed = dict(full)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in trimmed:
            trimmed[name] = trimmed[name][:TOKENIZER_VOCAB]
    single = SingleDeviceTRTLLMModelWeightsConverter(ExportConfig(inference_tp_size=TP, use_parallel_embedding=True),
                                                     config, DataType.float32)
    single.convert(dict(trimmed), DEFAULT_CONVERSION_DICT)
    for result in results:
        expected = expected_rank_weights(trimmed, shape, TP, result["rank"], parallel_embedding=True)
        assert_weights_equal(result["parallel_state"], expected)
        assert_weights_equal(result["pg_collection"], expected)
        assert result["parallel_state"]["transformer.vocab_embedding.weight"].shape == (TOKENIZER_VOCAB // TP, 32)
        own = f".{result['rank']}.bin"
        from_single = {k[: -len(own)] if k.endswith(own) else k: v for k, v in single.trtllm_model_weights.items()
                       if not k.endswith(".bin") or k.endswith(own)}
        for name in ("transformer.vocab_embedding.weight", "transformer.position_embedding.weight", "lm_head.weight"):
            if name in from_single:
                from_single[name] = from_single[name].chunk(TP)[result["rank"]]
        assert_weights_equal(result["parallel_state"], from_single)
        assert "tokenizer_vocab_size (63)" in result["error"]
