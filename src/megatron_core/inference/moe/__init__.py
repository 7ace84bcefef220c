"""Fused MoE operations for inference (Megatron-Core's ``megatron.core.inference.moe``), in PyTorch.

Dense routing (``[tokens, topk]`` global expert ids) is turned into expert-grouped rows (:mod:`.permute`),
run through the local experts' stacked weights (:mod:`.fused_moe`, :mod:`.vllm_fused_moe`) and summed back
per token in fp32. Megatron-Core writes these as Triton kernels sized for CUDA graphs; here each is PyTorch
with the same inputs, outputs and valid-row rules (see each module for what differs). MXFP8 and NVLS paths
raise ``NotImplementedError`` naming what is missing.
"""

import enum

from megatron_core.inference.moe.fused_moe import ActivationType, mcore_fused_moe
from megatron_core.inference.moe.vllm_fused_moe import vllm_fused_moe

__all__ = ["ActivationType", "InferenceGroupedGemmBackend", "mcore_fused_moe", "vllm_fused_moe"]


class InferenceGroupedGemmBackend(enum.Enum):
    """The grouped-GEMM backends named by ``TransformerConfig.inference_grouped_gemm_backend`` (same strings)."""

    FLASHINFER = "flashinfer"
    TORCH = "torch"
    VLLM = "vllm"
