"""TensorRT-LLM architecture name of each exported model family (Megatron-Core's ``TRT_MODEL_TYPE_STRING``)."""

from __future__ import annotations

from megatron_core.export.model_type import ModelType

TRT_MODEL_TYPE_STRING: dict[ModelType, str] = {
    ModelType.gpt: "GPTForCausalLM",
    ModelType.gptnext: "GPTForCausalLM",
    ModelType.starcoder: "GPTForCausalLM",
    ModelType.mixtral: "LlamaForCausalLM",
    ModelType.llama: "LlamaForCausalLM",
    ModelType.gemma: "GemmaForCausalLM",
    ModelType.falcon: "FalconForCausalLM",
    ModelType.nemotron_nas: "DeciLMForCausalLM",
}
"""``ModelType`` -> the ``architecture`` string of TensorRT-LLM's pretrained config."""
