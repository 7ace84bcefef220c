"""get_gpt_layer_with_inference_spec: the local spec's numbers, the fused modules' checkpoint names, and generation.

A GPTModel on the inference spec loads the local-spec model's ``state_dict`` as is and gives bitwise the same
logits; its ``sharded_state_dict`` names the norms as Megatron's inference layers (fused norm + linear) do; the
static inference engine run on it reproduces Hugging Face's greedy continuation of the tiny Llama.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.contexts import StaticInferenceContext
from megatron_core.inference.engines import StaticInferenceEngine
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_inference_spec,
    get_gpt_layer_with_inference_submodules,
)
from megatron_core.transformer.transformer_config import MLATransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayerSubmodules
from tests.inference.llama_fixture import (
    GROUPS,
    HEADS,
    LAYERS,
    MAX_POS,
    VOCAB,
    hf_greedy,
    hf_llama,
    llama_to_mcore,
    load_into,
    mcore_config,
    mcore_llama,
    prompts,
)

pytest.importorskip("transformers")


def _inference_llama(spec_kwargs: dict | None = None, **config_overrides: object) -> GPTModel:
    return GPTModel(mcore_config(**config_overrides), get_gpt_layer_with_inference_spec(**(spec_kwargs or {})),
                    VOCAB, MAX_POS, position_embedding_type="rope", rotary_base=10000).eval()


def test_same_logits_as_the_local_spec_on_the_same_weights() -> None:
    """The local model's state_dict loads strictly; logits are bitwise equal."""
    local = mcore_llama(hf_llama())
    model = _inference_llama()
    model.load_state_dict(local.state_dict(), strict=True)
    ids = torch.tensor(prompts((12, 12)))
    pos = torch.arange(12).unsqueeze(0).expand(2, 12)
    with torch.no_grad():
        assert torch.equal(model(ids, pos, None), local(ids, pos, None))
    assert isinstance(get_gpt_layer_with_inference_submodules(), TransformerLayerSubmodules)


def _sharded_keys(model: GPTModel) -> set[str]:
    """The checkpoint keys (``ShardedTensor.key``; the dict keys stay the module names) of the decoder layers."""
    keys = {getattr(value, "key", name) for name, value in model.sharded_state_dict().items()}
    return {key for key in keys if key.startswith("decoder.layers.")}


def test_checkpoint_names_are_the_fused_modules() -> None:
    """Dense: norms under linear_qkv / linear_fc1; MoE keeps pre_mlp_layernorm; MLA + qk_layernorm: up-proj norms."""
    dense = _sharded_keys(_inference_llama())
    assert {"decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            "decoder.layers.mlp.linear_fc1.layer_norm_weight"} <= dense
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in dense)
    local = GPTModel(mcore_config(), get_gpt_layer_local_spec(), VOCAB, MAX_POS, position_embedding_type="rope")
    assert _sharded_keys(local) == dense  # checkpoints move between the two specs
    moe = _sharded_keys(_inference_llama(dict(num_experts=2), num_moe_experts=2, moe_router_topk=1))
    assert "decoder.layers.pre_mlp_layernorm.weight" in moe
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in moe
    mla_config = MLATransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, q_lora_rank=16,
                                      kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                                      ffn_hidden_size=64, add_bias_linear=False, use_cpu_initialization=True,
                                      rope_type="rope", qk_layernorm=True)
    mla_spec = get_gpt_layer_with_inference_spec(qk_layernorm=True, multi_latent_attention=True)
    mla = _sharded_keys(GPTModel(mla_config, mla_spec, VOCAB, MAX_POS, position_embedding_type="rope"))
    assert {"decoder.layers.input_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight",
            "decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight",
            "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight"} <= mla
    with pytest.raises(ValueError, match="qk_l2_norm=True is not supported with multi_latent_attention"):
        get_gpt_layer_with_inference_spec(qk_l2_norm=True, multi_latent_attention=True)


def test_static_engine_generates_hf_greedy_tokens() -> None:
    """The legacy static engine on the inference-spec model continues each prompt as HF greedy generate does."""
    hf = hf_llama()
    model = _inference_llama()
    load_into(model, llama_to_mcore(hf.state_dict(), LAYERS, HEADS, GROUPS))
    wrapper = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=2, max_sequence_length=64))
    engine = StaticInferenceEngine(TextGenerationController(wrapper, tokenizer=None), max_batch_size=2, legacy=True)
    batch = prompts((5, 8))
    params = SamplingParams(top_k=1, num_tokens_to_generate=5, termination_id=-1)
    results = engine.generate(prompts=batch, sampling_params=params)
    assert [r.generated_tokens for r in results] == [hf_greedy(hf, p, 5) for p in batch]
