"""Settings shared by Megatron-Core's export paths (Megatron-Core's ``megatron.core.export``).

The enums name the model families and weight data types an exporter understands, and
:class:`~megatron_core.export.export_config.ExportConfig` holds the target parallel layout. The
TensorRT-LLM exporter is ``export.trtllm`` (its weight conversion needs torch only).
"""
