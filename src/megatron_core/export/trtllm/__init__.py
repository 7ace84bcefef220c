"""TensorRT-LLM export (Megatron-Core's ``megatron.core.export.trtllm``).

:class:`~megatron_core.export.trtllm.trtllm_helper.TRTLLMHelper` turns a Megatron GPT state dict into
TensorRT-LLM's weight names and layouts, split per inference tensor/pipeline rank, and builds an engine.
The weight conversion needs only torch; the model configs and the engine build need the
``tensorrt_llm`` package, imported lazily in :mod:`._tensorrt_llm` (an ``ImportError`` naming it when absent).
"""
