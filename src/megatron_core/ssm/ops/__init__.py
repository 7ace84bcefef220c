"""Megatron-Core 0.19's Mamba op entry points (``ssm.ops``): the varlen SSD chunk scan and the varlen causal
convolution used by inference prefill, the decode steps over state slots (``causal_conv1d_update``,
``selective_state_update``), the prefix-cache state gathers and the deterministic-mode switches.

Every op runs on CPU in PyTorch (fp32 math, the reference); on CUDA with Triton the scan, the convolution update
and the SSM update run Triton kernels (this library's). Importing needs no Triton.
"""

from megatron_core.ssm.ops.causal_conv1d_varlen import causal_conv1d_varlen_fn
from megatron_core.ssm.ops.ssd_combined import mamba_chunk_scan_combined_varlen

__all__ = ["mamba_chunk_scan_combined_varlen", "causal_conv1d_varlen_fn"]
