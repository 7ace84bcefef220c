"""Hugging Face and NeMo models wrapped as ``MegatronModule`` s (``megatron.core.models.huggingface``).

``build_hf_model(config, "hf://...")`` builds the wrapper of a Qwen2 language model, a SigLIP vision encoder
or a Parakeet sound encoder; ``transformers`` (and NeMo for ``nemo://`` paths) is imported only when one is
built.
"""

from megatron_core.models.huggingface.module import HuggingFaceModule, build_hf_model

__all__ = ["HuggingFaceModule", "build_hf_model"]
