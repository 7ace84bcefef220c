"""TensorRT-LLM config class of each exported model family (Megatron-Core's ``TRT_MODEL_CONFIG``).

Megatron-Core builds this dict from ``tensorrt_llm`` at import (mock classes when it is missing). Here it
is a read-only mapping with the same keys whose lookups import ``tensorrt_llm`` lazily: ``TRT_MODEL_CONFIG[
ModelType.llama]`` is ``tensorrt_llm.models.llama.config.LLaMAConfig``, or an ``ImportError`` naming the package.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from megatron_core.export.model_type import ModelType
from megatron_core.export.trtllm._tensorrt_llm import HAVE_TRTLLM, import_tensorrt_llm

__all__ = ["HAVE_TRTLLM", "TRT_MODEL_CONFIG"]

_CONFIG_CLASS_PATHS: dict[ModelType, tuple[str, str]] = {
    ModelType.gpt: ("tensorrt_llm.models.gpt.config", "GPTConfig"),
    ModelType.gptnext: ("tensorrt_llm.models.gpt.config", "GPTConfig"),
    ModelType.starcoder: ("tensorrt_llm.models.gpt.config", "GPTConfig"),
    ModelType.mixtral: ("tensorrt_llm.models.llama.config", "LLaMAConfig"),
    ModelType.llama: ("tensorrt_llm.models.llama.config", "LLaMAConfig"),
    ModelType.gemma: ("tensorrt_llm.models", "GemmaConfig"),
    ModelType.falcon: ("tensorrt_llm.models.falcon.config", "FalconConfig"),
    ModelType.nemotron_nas: ("tensorrt_llm.models.nemotron_nas.config", "DeciConfig"),
}


class _LazyTRTModelConfig(Mapping):
    """``ModelType`` -> TensorRT-LLM config class, imported on lookup."""

    def __getitem__(self, model_type: ModelType) -> type:
        module_name, class_name = _CONFIG_CLASS_PATHS[model_type]
        module = import_tensorrt_llm(f"the TensorRT-LLM config of {model_type}", module_name)
        return getattr(module, class_name)

    def __iter__(self) -> Iterator[ModelType]:
        return iter(_CONFIG_CLASS_PATHS)

    def __len__(self) -> int:
        return len(_CONFIG_CLASS_PATHS)

    def __repr__(self) -> str:
        pairs = ", ".join(f"{k}: {m}.{c}" for k, (m, c) in _CONFIG_CLASS_PATHS.items())
        return f"TRT_MODEL_CONFIG({{{pairs}}})"


TRT_MODEL_CONFIG: Mapping[ModelType, type] = _LazyTRTModelConfig()
"""``ModelType`` -> TensorRT-LLM's pretrained-config class (imported from ``tensorrt_llm`` on lookup)."""
